// runplane's own script: only what plain HTML cannot do. Everything works without it
// (the server decides every action); with it, Approve waits for every confirmation.
"use strict";
(function () {
  function gate(form) {
    var boxes = form.querySelectorAll('input[type="checkbox"][name="ack"]');
    var button = form.querySelector('button[type="submit"]');
    if (!boxes.length || !button) return;
    function update() {
      var all = Array.prototype.every.call(boxes, function (b) { return b.checked; });
      button.disabled = !all;
      button.title = all ? "" : "Tick every resource to be deleted or replaced first";
    }
    Array.prototype.forEach.call(boxes, function (b) { b.addEventListener("change", update); });
    update();
  }
  function follow(log) {
    // Keep the newest line in view while the reader is at the bottom.
    var observer = new MutationObserver(function () {
      var near = log.scrollHeight - log.scrollTop - log.clientHeight < 80;
      if (near) log.scrollTop = log.scrollHeight;
    });
    observer.observe(log, { childList: true });
  }
  function start() {
    document.querySelectorAll("form[data-confirm-all]").forEach(gate);
    document.querySelectorAll("pre.log").forEach(follow);
  }
  if (document.readyState === "loading") document.addEventListener("DOMContentLoaded", start);
  else start();
})();
