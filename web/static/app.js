// The web UI's small behaviours (htmx does the rest): Enter sends, the message list follows
// a streaming answer, Send waits while an answer streams, and a lost connection is shown.
// No eval, no inline script: the page's Content-Security-Policy allows only these files.
(function () {
  'use strict';

  function messages() { return document.getElementById('messages'); }
  function streaming() { return document.querySelector('.msg.streaming') !== null; }

  // The message list scrolls inside the page (the header stays in view). It follows a
  // streaming answer while the reader is at the end, and always jumps to the end after Send.
  var following = true;
  function atEnd(m) { return m.scrollHeight - m.scrollTop - m.clientHeight < 48; }
  function scrollDown(force) {
    var m = messages();
    if (!m) { return; }
    if (force || following) { m.scrollTop = m.scrollHeight; following = true; }
  }
  document.addEventListener('scroll', function (e) {
    if (e.target === messages()) { following = atEnd(e.target); }
  }, true);

  // The message box's length: a counter from 80 % of the limit, and above it a plain
  // "too long" with Send off, rather than the browser cutting a paste short unseen.
  var COUNT_FROM = 0.8;
  function overLimit() {
    var box = document.getElementById('message');
    var limit = box ? parseInt(box.getAttribute('data-limit') || '0', 10) : 0;
    return limit > 0 && box.value.length > limit;
  }
  function updateCount() {
    var box = document.getElementById('message');
    var out = document.getElementById('message-count');
    if (!box || !out) { return; }
    var limit = parseInt(box.getAttribute('data-limit') || '0', 10);
    var n = box.value.length;
    var fmt = function (x) { return x.toLocaleString('en'); };
    out.hidden = !(limit > 0 && n >= limit * COUNT_FROM);
    out.classList.toggle('over', n > limit);
    out.textContent = n > limit
      ? 'Too long to send: ' + fmt(n) + ' characters, ' + fmt(n - limit) +
        ' over the limit of ' + fmt(limit) + '. Shorten it, or split it into two messages.'
      : fmt(n) + ' of ' + fmt(limit) + ' characters';
  }

  // Attach: a text, Markdown or HTML file is read here in the browser (HTML as its text);
  // a PDF goes to the server, which sends back its text (pypdf). The text is sent with the
  // message; a file longer than one message is read in parts first (web/attach.py).
  var ATTACH_MAX_BYTES = 1024 * 1024;
  var PDF_MAX_BYTES = 20 * 1024 * 1024;
  function setAttachment(name, text, what) {
    document.getElementById('attachment').value = text;
    document.getElementById('attachment-name').value = name;
    var shown = document.getElementById('attached');
    shown.hidden = !name;
    var box = document.getElementById('message');
    var limit = box ? parseInt(box.getAttribute('data-limit') || '0', 10) : 0;
    var long = limit > 0 && text.length > limit / 2;
    document.getElementById('attached-what').textContent = name
      ? 'Attached: ' + name + ' (' + (what ? what + ', ' : '') +
        text.length.toLocaleString('en') + ' characters' +
        (long ? '; a long file is read in parts before the answer' : '') + ')' : '';
  }
  function csrfHeaders() {
    try { return JSON.parse(document.body.getAttribute('hx-headers') || '{}'); }
    catch (err) { return {}; }
  }
  function attachPdf(file) {
    var what = document.getElementById('attached-what');
    document.getElementById('attached').hidden = false;
    what.textContent = 'Reading ' + file.name + '…';
    var body = new FormData();
    body.append('file', file, file.name);
    window.fetch('/chat/attachments', { method: 'POST', body: body, headers: csrfHeaders(),
                                        credentials: 'same-origin' })
      .then(function (r) {
        return r.json().catch(function () { return {}; }).then(function (data) {
          if (r.ok && typeof data.text === 'string') {
            setAttachment(data.name || file.name, data.text,
                          data.pages + (data.pages === 1 ? ' page' : ' pages'));
            return;
          }
          setAttachment('', '');
          var said = data.error && (data.error.message || data.error) || data.detail;
          notice(typeof said === 'string' ? said : r.status === 413
            ? 'That PDF is too large to attach (at most 20 MB).'
            : 'That PDF could not be read.');
        });
      }, function () {
        setAttachment('', '');
        notice('The appliance cannot be reached, so the PDF was not attached.');
      });
  }
  document.addEventListener('change', function (e) {
    if (!e.target || e.target.id !== 'attach' || !e.target.files.length) { return; }
    var file = e.target.files[0];
    e.target.value = '';
    var area = noticeArea();
    if (area) { area.replaceChildren(); }  // a new file: the last file's notice is stale
    if (/\.pdf$/i.test(file.name) || file.type === 'application/pdf') {
      if (file.size > PDF_MAX_BYTES) {
        notice('That PDF is too large to attach (at most 20 MB).');
        return;
      }
      attachPdf(file);
      return;
    }
    if (/\.(docx?|odt|rtf|xlsx?|pptx?|zip|gz|7z|rar|png|jpe?g|gif|webp|heic|bmp|tiff?|mp3|mp4|mov|exe)$/i.test(file.name) ||
        /^(image|audio|video)\//.test(file.type)) {
      notRead(file.name);
      return;
    }
    if (file.size > ATTACH_MAX_BYTES) {
      notice('That file is too large to attach (at most 1 MB of text).');
      return;
    }
    file.arrayBuffer().then(function (bytes) {
      // text has no NUL bytes; a file that is not UTF-8 is taken as Windows' own Western
      if (new Uint8Array(bytes).indexOf(0) !== -1) { notRead(file.name); return; }
      var raw;
      try { raw = new TextDecoder('utf-8', { fatal: true }).decode(bytes); }
      catch (err) { raw = new TextDecoder('windows-1252').decode(bytes); }
      var html = /\.html?$/i.test(file.name) || file.type === 'text/html';
      var text = html ? (new DOMParser().parseFromString(raw, 'text/html').body.textContent || '')
        : raw;
      setAttachment(file.name, text.replace(/\n{3,}/g, '\n\n').trim());
    });
  });
  // Pictures, Word files, archives: their bytes are not text, and read as text they only
  // confuse the model. Refused at once, in words.
  function notRead(name) {
    setAttachment('', '');
    notice('“' + name + '” is not a text file (a picture, a Word document or another ' +
           'binary file), so it cannot be attached. Save it as text or PDF and attach that.');
  }
  document.addEventListener('click', function (e) {
    if (e.target && e.target.id === 'attached-remove') { setAttachment('', ''); }
  });

  function updateSend() {
    var send = document.getElementById('send');
    if (send) { send.disabled = streaming() || overLimit(); }
  }
  document.addEventListener('input', function (e) {
    if (e.target && e.target.id === 'message') { updateCount(); updateSend(); }
  });

  // One notice at a time: a new one replaces the last, and a message that goes through
  // clears it.
  function noticeArea() { return document.getElementById('chat-notice'); }
  function notice(text) {
    var area = noticeArea() || document.querySelector('main');
    if (!area) { return; }
    var div = document.createElement('div');
    div.className = 'notice error';
    div.setAttribute('role', 'alert');
    div.textContent = text;
    if (area.id === 'chat-notice') { area.replaceChildren(div); } else { area.prepend(div); }
    return div;
  }

  // "Cannot be reached" lasts only while that is true: any answer from the server, or a
  // /health probe that gets one (every 1 s, backing off to 10 s), takes the notice away.
  var unreachable = null;
  var probeTimer = null;
  function reachable() {
    if (unreachable) { unreachable.remove(); unreachable = null; }
    if (probeTimer !== null) { window.clearTimeout(probeTimer); probeTimer = null; }
  }
  function probe(delay) {
    probeTimer = window.setTimeout(function () {
      probeTimer = null;
      window.fetch('/health', { cache: 'no-store' }).then(reachable, function () {
        if (unreachable) { probe(Math.min(delay * 2, 10000)); }
      });
    }, delay);
  }
  document.addEventListener('htmx:beforeSwap', function (e) {
    var form = document.getElementById('composer');
    if (!form || e.detail.requestConfig.elt !== form) { return; }
    var area = noticeArea();
    if (e.detail.xhr.status >= 400 && area) {
      e.detail.target = area;           // the refusal, in the one notice place
      e.detail.swapOverride = 'innerHTML';
    } else if (area) {
      area.replaceChildren();
    }
  });

  // Delete sends the page to /chat: replace the deleted conversation's history entry, so
  // that neither the address bar nor Back leads to a conversation that is gone.
  // A session that ended sends the page to the login (HX-Redirect): what was typed in the
  // box is kept in this tab for the same person, and put back when the chat page opens.
  var DRAFT = 'appliance-draft';
  function who() {
    var el = document.querySelector('header .who');
    return el ? el.textContent.trim() : '';
  }
  function keepDraft() {
    var box = document.getElementById('message');
    if (!box || !box.value.trim()) { return; }
    try {
      window.sessionStorage.setItem(DRAFT, JSON.stringify({ who: who(), text: box.value }));
    } catch (err) { /* storage off: nothing to keep it in */ }
  }
  function restoreDraft() {
    var box = document.getElementById('message');
    if (!box) { return; }
    var kept = null;
    try { kept = JSON.parse(window.sessionStorage.getItem(DRAFT) || 'null'); } catch (err) { kept = null; }
    if (!kept) { return; }
    window.sessionStorage.removeItem(DRAFT);
    if (kept.who === who() && !box.value) { box.value = kept.text; updateCount(); }
  }
  document.addEventListener('htmx:beforeOnLoad', function (e) {
    var xhr = e.detail.xhr;
    var to = xhr && xhr.getResponseHeader('HX-Redirect');
    if (to && xhr.status === 401) { keepDraft(); }
    if (to && e.detail.elt && e.detail.elt.hasAttribute('data-replace-url')) {
      e.preventDefault();
      window.location.replace(to);
    }
  });

  // A form the browser refuses (a weight below its minimum) is never sent: replace its
  // last status ("Saved.") with what is wrong, rather than leave the old one standing.
  function formNotice(form, kind, text) {
    var old = form.querySelector('.notice');
    var div = document.createElement('div');
    div.className = 'notice ' + kind;
    div.setAttribute('role', kind === 'error' ? 'alert' : 'status');
    div.textContent = text;
    var head = form.querySelector('h2');
    if (old) { old.replaceWith(div); } else if (head) { head.after(div); } else { form.prepend(div); }
    return div;
  }
  document.addEventListener('invalid', function (e) {  // each refused field, before submit
    var field = e.target;
    var form = field.form;
    if (!form || form.id === 'composer') { return; }
    var label = field.closest('label');
    var name = label && label.firstChild ? label.firstChild.textContent.trim() : '';
    var text = (name ? name + ': ' : '') + field.validationMessage;
    var said = form.querySelector('.notice[data-local]');
    if (said && form.getAttribute('data-checking')) {  // another field of the same try
      said.textContent += ' ' + text;
      return;
    }
    formNotice(form, 'error', 'Not saved. ' + text).setAttribute('data-local', '');
    form.setAttribute('data-checking', '1');
    window.setTimeout(function () { form.removeAttribute('data-checking'); }, 0);
  }, true);
  document.addEventListener('submit', function (e) {  // a new try: the old reasons go
    var old = e.target.querySelector && e.target.querySelector('.notice[data-local]');
    if (old) { old.remove(); }
  }, true);
  document.addEventListener('input', function (e) {  // an edit makes "Saved." stale
    var form = e.target && e.target.closest && e.target.closest('form');
    var ok = form && form.querySelector('.notice.ok');
    if (ok) { ok.remove(); }
  });

  // Phones: the header's links and Log out fold into a Menu, a conversation's Rename, Export
  // and Delete into "⋯" (the CSS shows these buttons only on a narrow screen, and only with
  // this script: without it everything stays in the page). A button[data-fold] opens the
  // element it controls; Esc or a click elsewhere closes it, and Esc puts focus back on it.
  document.documentElement.classList.add('js');
  function openFold() { return document.querySelector('button[data-fold][aria-expanded="true"]'); }
  function setFold(button, open, refocus) {
    var panel = document.getElementById(button.getAttribute('aria-controls'));
    button.setAttribute('aria-expanded', open ? 'true' : 'false');
    if (!panel) { return; }
    panel.classList.toggle('open', open);
    if (open) {
      var first = panel.querySelector('a, button, summary');
      if (first) { first.focus(); }
    } else if (refocus) {
      button.focus();
    }
  }
  function inFold(el, button) {
    var panel = document.getElementById(button.getAttribute('aria-controls'));
    return !!el && (el === button || (!!panel && panel.contains(el)));
  }
  document.addEventListener('click', function (e) {
    var button = e.target.closest && e.target.closest('button[data-fold]');
    var open = openFold();
    if (open && !inFold(e.target, open)) { setFold(open, false, false); }
    if (button) { setFold(button, button.getAttribute('aria-expanded') !== 'true', false); }
  });
  document.addEventListener('focusout', function (e) {  // tabbed past the last item
    var open = openFold();
    var to = e.relatedTarget;
    if (open && to && !inFold(to, open)) { setFold(open, false, false); }
  });

  function focusBox() {
    var box = document.getElementById('message');
    if (box) { box.focus(); }
  }
  // Esc: closes the phone Menu, or the open Rename, Export or Edit panel (focus back on its
  // button or summary), else stops the answer being written (or the file being read).
  document.addEventListener('keydown', function (e) {
    if (e.key !== 'Escape' || e.isComposing || e.defaultPrevented) { return; }
    var open = document.querySelectorAll('details.rename[open], details.export[open], details.edit[open]');
    if (open.length) {
      var panel = (e.target && e.target.closest && e.target.closest('details[open]')) ||
        open[open.length - 1];
      panel.open = false;
      var summary = panel.querySelector('summary');
      if (summary) { summary.focus(); }
      e.preventDefault();
      return;
    }
    var fold = openFold();
    if (fold) {
      setFold(fold, false, true);
      e.preventDefault();
      return;
    }
    var stop = document.querySelector('.msg.streaming .stop');
    if (stop && !stop.disabled) {
      e.preventDefault();
      stop.click();
    }
  });

  document.addEventListener('keydown', function (e) {
    if (e.target && e.target.id === 'message' && e.key === 'Enter' && !e.shiftKey &&
        !e.isComposing) {
      e.preventDefault();
      var form = document.getElementById('composer');
      if (form && !streaming() && !overLimit() && e.target.value.trim() !== '') {
        form.requestSubmit();
      }
    }
  });

  document.addEventListener('htmx:afterRequest', function (e) {
    var xhr = e.detail.xhr;
    if (!xhr || xhr.status === 0) { return; }  // never reached the server: nothing changes
    reachable();
    var stopped = e.detail.elt;
    if (stopped && stopped.classList && stopped.classList.contains('stop')) {
      focusBox();  // Stop's button goes with the answer: the box is where to type next
    }
    var form = document.getElementById('composer');
    // the box empties only when the message was taken; a refusal or a lost connection
    // keeps what was typed, to send again
    if (form && e.detail.elt === form && xhr.status >= 200 && xhr.status < 300) {
      document.getElementById('message').value = '';
      if (document.getElementById('attachment')) { setAttachment('', ''); }
      updateCount();
    }
  });
  document.addEventListener('htmx:afterSwap', function (e) {
    updateSend();
    var form = document.getElementById('composer');
    var elt = e.detail.requestConfig && e.detail.requestConfig.elt;
    if (form && elt === form) {
      scrollDown(true);  // the question just sent and its answer: in view
      focusBox();  // after a mouse Send too, the next question is typed at once
    }
    // Regenerate, Continue, Edit and the answer's version arrows replace the messages (or the
    // answer), and the button that had focus with them: keyboard focus goes to the message
    // box rather than falling to the page.
    if (elt && elt.closest && !elt.isConnected &&
        elt.closest('.regen, .continue, .edit-form, .branches, .msg')) {
      focusBox();
      if (!elt.closest('.msg.assistant') || elt.closest('.regen, .continue')) { scrollDown(true); }
    }
  });
  document.addEventListener('htmx:afterSettle', function () { updateSend(); scrollDown(false); });
  document.addEventListener('htmx:sseMessage', function () { scrollDown(false); });
  document.addEventListener('htmx:sseClose', updateSend);
  // An answer's stream that fails (connection lost, logged out, answer gone) is not retried:
  // the server cancelled the request when the stream went away.
  document.addEventListener('htmx:sseError', function (e) {
    var elt = e.target;
    var source = e.detail && e.detail.source;
    if (!elt || !elt.classList || !elt.classList.contains('streaming') ||
        !source || source.readyState !== EventSource.CLOSED) { return; }
    source.close();
    elt.removeAttribute('sse-connect');
    elt.classList.remove('streaming');
    elt.classList.add('interrupted');
    var stop = elt.querySelector('.stop');
    if (stop) { stop.remove(); }
    var note = document.createElement('p');
    note.className = 'notice error';
    note.setAttribute('role', 'alert');
    note.textContent = 'The connection to the answer was lost, so it stopped. Send again to retry.';
    elt.appendChild(note);
    updateSend();
  });
  document.addEventListener('htmx:sendError', function (e) {
    var form = document.getElementById('composer');
    var sending = form && e.detail && e.detail.elt === form;
    unreachable = notice('The appliance cannot be reached. ' + (sending
      ? 'Your message is kept: send it again when the connection is back.'
      : 'Check the connection and try again.'));
    if (probeTimer === null) { probe(1000); }
  });
  // The dashboard's live figures: its own EventSource (not the htmx extension), so that the
  // server ending a stream on schedule ("bye") is a quiet reconnect, not a logged error.
  // Each frame brings a "beat": without one for STALE_MS, or when a connection fails, the
  // figures are greyed and the dot says since when the appliance has not answered.
  function dashboard(root) {
    var STALE_MS = 4000;
    var dot = document.getElementById('live-dot');
    var delay = 250, last = Date.now(), down = false, watch = null;
    function hhmm(t) {
      var d = new Date(t);
      return ('0' + d.getHours()).slice(-2) + ':' + ('0' + d.getMinutes()).slice(-2);
    }
    function away() {
      if (down) { return; }
      down = true;
      root.classList.add('stale');
      if (dot) { dot.textContent = 'not answering since ' + hhmm(last); dot.classList.add('off'); }
    }
    function fresh() {
      last = Date.now();
      if (down) { down = false; root.classList.remove('stale'); }
      if (dot) { dot.textContent = 'live'; dot.classList.remove('off'); }
      window.clearTimeout(watch);
      watch = window.setTimeout(away, STALE_MS);
    }
    function open() {
      var source = new EventSource(root.getAttribute('data-stream'));
      root.querySelectorAll('[data-part]').forEach(function (part) {
        source.addEventListener(part.getAttribute('data-part'), function (e) {
          part.innerHTML = e.data;  // HTML rendered by our own server's templates
          fresh();
        });
      });
      source.addEventListener('beat', fresh);
      source.addEventListener('open', function () { delay = 250; });
      source.addEventListener('bye', function () { source.close(); open(); });
      source.onerror = function () {  // the server went away: say so, retry, back off
        source.close();
        away();
        window.setTimeout(open, delay);
        delay = Math.min(delay * 2, 10000);
      };
    }
    fresh();
    open();
  }

  // Copy: an answer, a code block, a new API key. The Clipboard API needs a secure page
  // (https or localhost); on a plain-http LAN address the selection is copied instead.
  function copyText(text, button) {
    function done(ok) {
      var was = button.getAttribute('data-label') || button.textContent;
      button.setAttribute('data-label', was);
      button.textContent = ok ? 'Copied' : 'Select and copy by hand';
      window.setTimeout(function () { button.textContent = was; }, 1500);
    }
    if (navigator.clipboard && window.isSecureContext) {
      navigator.clipboard.writeText(text).then(function () { done(true); },
                                                function () { done(false); });
      return;
    }
    var area = document.createElement('textarea');
    area.value = text;
    area.setAttribute('readonly', '');
    area.className = 'visually-hidden';
    document.body.appendChild(area);
    area.select();
    var ok = false;
    try { ok = document.execCommand('copy'); } catch (err) { ok = false; }
    area.remove();
    button.focus();
    done(ok);
  }
  document.addEventListener('click', function (e) {
    var button = e.target.closest && e.target.closest('[data-copy]');
    if (!button) { return; }
    var what = button.getAttribute('data-copy');
    var source = what === 'answer' ? button.closest('.msg').querySelector('.body')
      : what === 'code' ? button.parentElement.querySelector('code')
        : document.querySelector(what);
    if (source) { copyText(source.innerText.replace(/\n$/, ''), button); }
  });

  // Read aloud: the browser's own speech (speechSynthesis), nothing leaves the house. A
  // local (offline) voice in the page's language is preferred; the button is shown only
  // where the browser has speech at all. One answer at a time; pressed again, it stops.
  var speech = 'speechSynthesis' in window && 'SpeechSynthesisUtterance' in window
    ? window.speechSynthesis : null;
  if (speech) { document.documentElement.classList.add('speech'); }
  var speaking = null;
  function pickVoice() {
    var lang = (document.documentElement.lang || navigator.language || 'en').toLowerCase();
    var voices = speech.getVoices();
    function score(v) {
      var same = (v.lang || '').toLowerCase().indexOf(lang.split('-')[0]) === 0;
      return (v.localService ? 4 : 0) + (same ? 2 : 0) + (v['default'] ? 1 : 0);
    }
    var best = null;
    voices.forEach(function (v) { if (!best || score(v) > score(best)) { best = v; } });
    return best;
  }
  function quiet(button) {
    button.textContent = 'Read aloud';
    if (speaking === button) { speaking = null; }
  }
  document.addEventListener('click', function (e) {
    var button = e.target.closest && e.target.closest('[data-speak]');
    if (!button || !speech) { return; }
    var again = speaking === button;
    if (speaking) { quiet(speaking); }
    speech.cancel();
    if (again) { return; }  // pressed while reading: that was Stop
    var body = button.closest('.msg').querySelector('.body');
    if (!body) { return; }
    var said = new window.SpeechSynthesisUtterance(body.innerText);
    var voice = pickVoice();
    if (voice) { said.voice = voice; said.lang = voice.lang; }
    said.onend = said.onerror = function () { quiet(button); };
    speaking = button;
    button.textContent = 'Stop reading';
    speech.speak(said);
  });

  // Code blocks: colours from the vendored highlight.js, and a Copy button on each.
  function decorate(root) {
    (root || document).querySelectorAll('.md pre > code').forEach(function (code) {
      var pre = code.parentElement;
      if (pre.getAttribute('data-done')) { return; }
      pre.setAttribute('data-done', '1');
      if (window.hljs) { window.hljs.highlightElement(code); }
      var button = document.createElement('button');
      button.type = 'button';
      button.className = 'copy-code';
      button.setAttribute('data-copy', 'code');
      button.textContent = 'Copy code';
      pre.insertBefore(button, code);
    });
  }
  document.addEventListener('htmx:afterSettle', function () { decorate(); });

  document.addEventListener('DOMContentLoaded', function () {
    if (window.hljs) { window.hljs.configure({ ignoreUnescapedHTML: true }); }
    decorate();
    var dash = document.getElementById('dashboard');
    if (dash && dash.getAttribute('data-stream')) { dashboard(dash); }
    var list = document.querySelector('details.conversations');
    if (list && window.matchMedia('(max-width: 720px)').matches) { list.open = false; }
    if (messages()) { scrollDown(true); }
    restoreDraft();
    updateSend();
  });
})();
