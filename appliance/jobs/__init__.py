"""Background jobs: scheduled or on-demand summaries that run as the owner's ``background``
requests through the same service path as HTTP requests.

- ``schedule``: cron / interval / none, the household time zone, next times in words
- ``netguard``: which addresses a url job or webhook may reach (SSRF guard)
- ``fetch``: HTTP(S) downloads with size and time caps, every redirect re-checked
- ``sources``: text, url (HTML page or RSS/Atom feed, new items only), conversations
- ``mapreduce``: token-sized chunks summarised, then combined
- ``runner``: ``JobService``, the APScheduler ``AsyncIOScheduler`` and which runs start
- ``run``: the life of one run (source, summary, output, webhook)
"""
