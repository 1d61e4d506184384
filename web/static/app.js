// The web UI's small behaviours (htmx does the rest): Enter sends, the message list follows
// a streaming answer, Send waits while an answer streams, and a lost connection is shown.
// No eval, no inline script: the page's Content-Security-Policy allows only these files.
(function () {
  'use strict';

  function messages() { return document.getElementById('messages'); }
  function streaming() { return document.querySelector('.msg.streaming') !== null; }

  function scrollDown(force) {
    var m = messages();
    if (!m) { return; }
    var box = document.scrollingElement || document.documentElement;
    var near = box.scrollHeight - box.scrollTop - window.innerHeight < 160;
    if (force || near) { window.scrollTo(0, box.scrollHeight); }
  }

  function updateSend() {
    var send = document.getElementById('send');
    if (send) { send.disabled = streaming(); }
  }

  function notice(text) {
    var m = messages() || document.querySelector('main');
    if (!m) { return; }
    var div = document.createElement('div');
    div.className = 'notice error';
    div.setAttribute('role', 'alert');
    div.textContent = text;
    m.appendChild(div);
  }

  document.addEventListener('keydown', function (e) {
    if (e.target && e.target.id === 'message' && e.key === 'Enter' && !e.shiftKey &&
        !e.isComposing) {
      e.preventDefault();
      var form = document.getElementById('composer');
      if (form && !streaming() && e.target.value.trim() !== '') { form.requestSubmit(); }
    }
  });

  document.addEventListener('htmx:afterRequest', function (e) {
    var form = document.getElementById('composer');
    if (form && e.detail.elt === form && e.detail.successful) {
      document.getElementById('message').value = '';
    }
  });
  document.addEventListener('htmx:afterSwap', updateSend);
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
  document.addEventListener('htmx:sendError', function () {
    notice('The appliance cannot be reached. Check the connection and try again.');
  });
  document.addEventListener('DOMContentLoaded', function () {
    if (messages()) { scrollDown(true); }
    updateSend();
    var list = document.querySelector('details.conversations');
    if (list && window.matchMedia('(max-width: 720px)').matches) { list.open = false; }
  });
})();
