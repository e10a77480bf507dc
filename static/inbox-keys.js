// Airlock approvals inbox: keyboard-first decisions (issue 42 §3). Loaded from 'self' by
// templates/approvals/inbox.html (strict CSP: no inline script, no eval). Everything it
// does is a click on, or the focus of, a control the page already has: without this file
// the inbox is the same plain forms.
//
// j/k move between cards, a approves (a delete or a class marked for it asks first, in a
// dialog), r focuses the comment a rejection requires (Ctrl+Enter there rejects), e opens
// the edit form ([data-key-form="edit"]), g the grant form ([data-key-form="grant"], where
// a card has one), c claims or releases, ? lists the keys. The live refresh swaps cards
// and claim lines; the focused card is remembered by id and given the focus back.
(function () {
  "use strict";
  var remembered = null; // the id of the card the person is on
  var pendingApprove = null; // the card whose approval waits for the confirmation dialog

  function items() { return document.getElementById("approval-items"); }
  function cards() {
    var root = items();
    return root ? Array.prototype.slice.call(root.querySelectorAll("article.approval")) : [];
  }
  function cardOf(el) { return el && el.closest ? el.closest("article.approval") : null; }
  function current() {
    var card = cardOf(document.activeElement);
    if (card) { return card; }
    return remembered ? document.getElementById(remembered) : null;
  }
  function say(text) {
    var status = document.getElementById("inbox-keys-status");
    if (status) { status.textContent = text; }
  }
  function title(card) {
    var h = card.querySelector("h2");
    return h ? h.textContent.trim() : "approval";
  }
  function focusCard(card) {
    if (!card) { return; }
    remembered = card.id;
    card.focus({ preventScroll: true });
    card.scrollIntoView({ block: "nearest" });
  }
  function move(step) {
    var all = cards();
    if (!all.length) { say("Nothing is waiting."); return; }
    var at = all.indexOf(current());
    var next = at < 0 ? all[step > 0 ? 0 : all.length - 1] : all[Math.min(all.length - 1, Math.max(0, at + step))];
    focusCard(next);
    say((all.indexOf(next) + 1) + " of " + all.length + ": " + title(next));
  }
  function typing(el) {
    if (!el) { return false; }
    var tag = el.tagName;
    return tag === "INPUT" || tag === "TEXTAREA" || tag === "SELECT" || el.isContentEditable;
  }
  function dialogOpen() { return document.querySelector("dialog[open]") !== null; }

  function approve(card) {
    var button = card.querySelector("[data-key-approve]");
    if (!button) { say("This card cannot be approved here."); return; }
    if (card.getAttribute("data-destructive") === "true") {
      var dialog = document.getElementById("inbox-confirm");
      var text = document.getElementById("inbox-confirm-text");
      if (!dialog || !text) { return; }
      text.textContent = title(card) + " — this deletes or is of a class that asks for a confirmation.";
      pendingApprove = card.id;
      dialog.showModal();
      return;
    }
    button.click();
  }
  function confirmed(dialog) {
    var card = pendingApprove ? document.getElementById(pendingApprove) : null;
    pendingApprove = null;
    if (dialog.returnValue !== "yes" || !card) { focusCard(card); return; }
    var box = card.querySelector("input[name='confirm']");
    if (box) { box.checked = true; }
    var button = card.querySelector("[data-key-approve]");
    focusCard(card);
    if (button) { button.click(); }
  }
  function reject(card) {
    var comment = card.querySelector("[data-key-comment]");
    if (!comment) { say("This card cannot be rejected here."); return; }
    card.setAttribute("data-intent", "reject");
    comment.focus();
    say("Write why you reject it, then press Control+Enter to reject, or Escape to go back.");
  }
  function openForm(card, name) {
    var form = card.querySelector("[data-key-form='" + name + "']");
    if (!form) { say(name === "grant" ? "No grant form on this card." : "No edit form on this card."); return; }
    if (form.tagName === "DETAILS") { form.open = true; }
    var field = form.querySelector("textarea, input:not([type=hidden]), select, button");
    if (field) { field.focus(); }
  }
  function claim(card) {
    var button = card.querySelector(".claim form button");
    if (button) { button.click(); } else { say("Nothing to claim on this card."); }
  }
  function showHelp() {
    var help = document.getElementById("inbox-keys-help");
    if (help && !help.open) { help.showModal(); }
  }

  document.addEventListener("keydown", function (event) {
    if (!items()) { return; }
    var target = event.target;
    if (event.key === "Escape" && typing(target) && cardOf(target)) {
      // Leave the field, stay on the card.
      var card = cardOf(target);
      card.removeAttribute("data-intent");
      focusCard(card);
      event.preventDefault();
      return;
    }
    if (event.key === "Enter" && (event.ctrlKey || event.metaKey) && target.hasAttribute &&
        target.hasAttribute("data-key-comment")) {
      var on = cardOf(target);
      var button = on && on.getAttribute("data-intent") === "reject" ? on.querySelector("[data-key-reject]") : null;
      if (button) {
        event.preventDefault();
        on.removeAttribute("data-intent");
        remembered = on.id;
        button.click();
      }
      return;
    }
    if (event.ctrlKey || event.metaKey || event.altKey || typing(target) || dialogOpen()) { return; }
    var key = event.key;
    if (key === "?") { event.preventDefault(); showHelp(); return; }
    if (key === "j" || key === "k") { event.preventDefault(); move(key === "j" ? 1 : -1); return; }
    if ("aregc".indexOf(key) < 0 || key.length !== 1) { return; }
    var card2 = current();
    if (!card2) { say("Press j to choose a card first."); return; }
    event.preventDefault();
    remembered = card2.id;
    if (card2.getAttribute("data-status") !== "pending") { say("This one is already decided."); return; }
    if (key === "a") { approve(card2); }
    else if (key === "r") { reject(card2); }
    else if (key === "e") { openForm(card2, "edit"); }
    else if (key === "g") { openForm(card2, "grant"); }
    else if (key === "c") { claim(card2); }
  });

  // A click on Approve of a card that asks for a confirmation: the same dialog, unless
  // the box is ticked already (the plain form's confirmation, or the dialog's own click).
  document.addEventListener("click", function (event) {
    var button = event.target.closest ? event.target.closest("[data-key-approve]") : null;
    if (!button) { return; }
    var card = cardOf(button);
    var box = card && card.querySelector("input[name='confirm']");
    if (card && card.getAttribute("data-destructive") === "true" && box && !box.checked) {
      event.preventDefault();
      approve(card);
    }
  }, true);

  document.addEventListener("focusin", function (event) {
    var card = cardOf(event.target);
    if (card) { remembered = card.id; }
  });

  // The live refresh (and a decision's own swap) replaces elements: if the focus went
  // with them, give it back to the remembered card — never to anything else.
  document.addEventListener("htmx:afterSettle", function () {
    var active = document.activeElement;
    if (remembered && (!active || active === document.body || !document.contains(active))) {
      var card = document.getElementById(remembered);
      if (card) { card.focus({ preventScroll: true }); }
    }
  });

  // The poller tells the server which cards are still pending here and what claim each
  // shows, so it answers only with what changed (and 204 when nothing did).
  document.addEventListener("htmx:configRequest", function (event) {
    var elt = event.detail.elt;
    if (!elt || elt.id !== "approval-poll") { return; }
    var shown = cards().filter(function (card) {
      return card.getAttribute("data-status") === "pending";
    }).map(function (card) {
      var box = card.querySelector(".claim[data-claim]");
      return card.id.replace(/^approval-/, "") + "~" + (box ? box.getAttribute("data-claim") : "-");
    });
    if (shown.length) { event.detail.parameters.shown = shown.join(","); }
  });

  document.addEventListener("DOMContentLoaded", function () {
    var hint = document.getElementById("inbox-keys-hint");
    if (hint) { hint.hidden = false; }
    var open = document.getElementById("inbox-keys-open");
    if (open) { open.addEventListener("click", showHelp); }
    var confirmDialog = document.getElementById("inbox-confirm");
    if (confirmDialog) { confirmDialog.addEventListener("close", function () { confirmed(confirmDialog); }); }
    var help = document.getElementById("inbox-keys-help");
    if (help) {
      help.addEventListener("close", function () {
        var card = remembered ? document.getElementById(remembered) : null;
        if (card) { card.focus({ preventScroll: true }); }
      });
    }
  });
})();
