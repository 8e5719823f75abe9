/*
 * Numeric mock interview (docs/practice/mock-interview.md): one question at a time, drawn
 * afresh per attempt from the templates of reference_impl/interview/mock_questions.py (its copy
 * data/mock/questions.json), answered by the calculators, with chained follow-ups, a
 * clock, and self-grading.
 *
 * It leans on two interfaces and nothing else of the other scripts:
 *   - window.handbookCalc.<calc>(inputs) (calculators.js) computes every answer, as
 *     reference_impl.calc.<calc>(**inputs) does for the Python copy of the bank;
 *   - the quiz's marks (quiz.js): localStorage key "handbook-quiz:" + page path + "#" +
 *     question, value "knew" or "again". A mock question marked "Review again" is stored
 *     under this page's path and the template's title, so it joins the review list.
 *
 * window.handbookMock exposes the draw for tests: seed(n) makes the next draws repeatable,
 * current() is the question on screen, answer(id, params) the calculator's answer.
 */
(function () {
  "use strict";

  var QUIZ_PREFIX = "handbook-quiz:"; // quiz.js's PREFIX: one review list for both
  var DATA_URL = new URL("../data/mock/questions.json", document.currentScript.src).href;
  var OPS = { double: function (v) { return v * 2; }, halve: function (v) { return v / 2; } };
  var bank = null;
  var random = seeded(Math.floor(Math.random() * 4294967296));
  var state = null;

  // mulberry32: a small seeded generator, so a test can replay a draw.
  function seeded(seed) {
    var a = seed >>> 0;
    return function () {
      a = (a + 0x6d2b79f5) >>> 0;
      var t = a;
      t = Math.imul(t ^ (t >>> 15), t | 1);
      t ^= t + Math.imul(t ^ (t >>> 7), t | 61);
      return ((t ^ (t >>> 14)) >>> 0) / 4294967296;
    };
  }

  function pick(list) {
    return list[Math.floor(random() * list.length)];
  }

  function template(id) {
    return bank.templates.filter(function (t) { return t.id === id; })[0];
  }

  // The data's input spelling (see reference_impl/interview/mock_questions.py): "$name" is a
  // parameter, a list is a product, anything else a literal.
  function resolve(t, params) {
    function value(spec) {
      if (Array.isArray(spec)) return spec.reduce(function (acc, item) { return acc * value(item); }, 1);
      if (typeof spec === "string" && spec.charAt(0) === "$") return params[spec.slice(1)];
      return spec;
    }
    var inputs = {};
    Object.keys(t.inputs).forEach(function (name) { inputs[name] = value(t.inputs[name]); });
    return inputs;
  }

  function answer(t, params) {
    return window.handbookCalc[t.calc](resolve(t, params))[t.key] / t.unit_scale;
  }

  function fill(text, params) {
    return text.replace(/\{(\w+)\}/g, function (match, name) {
      return name in params ? String(params[name]) : match;
    });
  }

  function figure(x) {
    return Number(x.toPrecision(3)).toLocaleString("en-US", { maximumFractionDigits: 6 });
  }

  // ------------------------------------------------------------ the quiz's review list

  function mark(title, value) {
    try {
      localStorage.setItem(QUIZ_PREFIX + location.pathname + "#" + title, value);
    } catch (err) {
      /* storage disabled (private mode): the mark lasts this visit only */
    }
  }

  function reviewList() {
    var items = [];
    try {
      for (var i = 0; i < localStorage.length; i++) {
        var key = localStorage.key(i);
        if (key.indexOf(QUIZ_PREFIX) === 0 && localStorage.getItem(key) === "again") {
          var rest = key.slice(QUIZ_PREFIX.length), hash = rest.indexOf("#");
          items.push({ path: rest.slice(0, hash), question: rest.slice(hash + 1) });
        }
      }
    } catch (err) {
      /* storage disabled: an empty list */
    }
    return items.sort(function (a, b) { return (a.path + a.question).localeCompare(b.path + b.question); });
  }

  // ------------------------------------------------------------ the page

  function element(tag, attrs, text) {
    var node = document.createElement(tag);
    Object.keys(attrs || {}).forEach(function (key) { node.setAttribute(key, attrs[key]); });
    if (text !== undefined) node.textContent = text;
    return node;
  }

  function showReviewList(host) {
    var list = host.querySelector(".handbook-mock__review");
    var items = reviewList();
    list.textContent = "";
    if (!items.length) list.appendChild(element("li", {}, "Nothing to review yet."));
    items.forEach(function (item) {
      var li = element("li");
      li.appendChild(element("a", { href: item.path }, item.question));
      list.appendChild(li);
    });
  }

  function clock(seconds) {
    var s = Math.max(0, Math.ceil(seconds));
    return Math.floor(s / 60) + ":" + String(s % 60).padStart(2, "0");
  }

  function tick(host) {
    var left = state.deadline - Date.now() / 1000;
    host.querySelector(".handbook-mock__timer").textContent = clock(left) + " left";
    if (left <= 0) finish(host, "Time is up.");
  }

  function finish(host, why) {
    clearInterval(state.timer);
    var s = state;
    host.querySelector(".handbook-mock__card").hidden = true;
    host.querySelector(".handbook-mock__summary").textContent =
      why + " " + s.asked + " answered, " + s.close + " within " + Math.round(bank.tolerance * 100) +
      "%, " + s.again + " marked to review.";
    host.querySelector(".handbook-mock__start").disabled = false;
    state.done = true;
  }

  function ask(host) {
    var card = host.querySelector(".handbook-mock__card");
    var t = state.template, q = state.question;
    card.querySelector(".handbook-mock__title").textContent =
      t.title + (q.step >= 0 ? " (follow-up " + (q.step + 1) + ")" : "");
    card.querySelector(".handbook-mock__followup").textContent =
      q.step >= 0 ? fill(t.follow_ups[q.step].say, q.params) : "";
    card.querySelector(".handbook-mock__question").textContent = fill(t.question, q.params);
    card.querySelector(".handbook-mock__unit").textContent = t.unit;
    var input = card.querySelector(".handbook-mock__answer");
    input.value = "";
    input.disabled = false;
    card.querySelector(".handbook-mock__check").disabled = false;
    card.querySelector(".handbook-mock__reveal").hidden = true;
    input.focus();
  }

  function next(host) {
    var t = state.template;
    if (t && state.question.step + 1 < t.follow_ups.length) {
      var step = state.question.step + 1, change = t.follow_ups[step];
      var params = Object.assign({}, state.question.params);
      params[change.param] = OPS[change.op](params[change.param]);
      state.question = { params: params, step: step, answer: answer(t, params) };
    } else {
      var others = bank.templates.filter(function (c) { return c !== t; });
      t = state.template = pick(others);
      var drawn = {};
      Object.keys(t.params).forEach(function (name) { drawn[name] = pick(t.params[name]); });
      state.question = { params: drawn, step: -1, answer: answer(t, drawn) };
    }
    ask(host);
  }

  function check(host) {
    var card = host.querySelector(".handbook-mock__card");
    var t = state.template, q = state.question;
    var given = parseFloat(card.querySelector(".handbook-mock__answer").value);
    var error = Math.abs(given - q.answer) / Math.abs(q.answer);
    var close = Number.isFinite(given) && error <= bank.tolerance;
    state.asked += 1;
    if (close) state.close += 1;
    card.querySelector(".handbook-mock__answer").disabled = true;
    card.querySelector(".handbook-mock__check").disabled = true;
    card.querySelector(".handbook-mock__verdict").textContent = !Number.isFinite(given) ? "No answer given."
      : close ? "Within " + Math.round(bank.tolerance * 100) + "%."
      : "Off by " + figure(error * 100) + "% (" + (given > q.answer ? "too high" : "too low") + ").";
    card.querySelector(".handbook-mock__expected").textContent = figure(q.answer) + " " + t.unit;
    card.querySelector(".handbook-mock__formula").textContent =
      fill(t.formula, q.params) + " = " + figure(q.answer) + " " + t.unit;
    var reveal = card.querySelector(".handbook-mock__reveal");
    reveal.hidden = false;
    reveal.querySelector(close ? ".handbook-mock__knew" : ".handbook-mock__again").focus();
  }

  // One mark per template: a miss anywhere in its chain keeps it on the review list even if
  // a later follow-up of this mock goes well.
  function grade(host, value) {
    var title = state.template.title;
    if (value === "again") {
      state.again += 1;
      state.missed[title] = true;
    }
    if (value === "again" || !state.missed[title]) mark(title, value);
    showReviewList(host);
    if (!state.done) next(host);
  }

  function start(host) {
    var minutes = Number(host.querySelector(".handbook-mock__mode").value);
    if (state) clearInterval(state.timer);
    state = { deadline: Date.now() / 1000 + minutes * 60, asked: 0, close: 0, again: 0, done: false, missed: {},
      template: null, question: null };
    state.timer = setInterval(function () { tick(host); }, 1000);
    host.querySelector(".handbook-mock__summary").textContent = "";
    host.querySelector(".handbook-mock__card").hidden = false;
    host.querySelector(".handbook-mock__start").disabled = true;
    tick(host);
    next(host);
  }

  function render(host) {
    host.innerHTML =
      '<p class="handbook-mock__controls"><label>Clock <select class="handbook-mock__mode">' +
      '<option value="15">15 min</option><option value="30">30 min</option><option value="45">45 min</option>' +
      '</select></label> <button type="button" class="md-button md-button--primary handbook-mock__start">' +
      'Start</button> <button type="button" class="md-button handbook-mock__stop">Stop</button> ' +
      '<strong class="handbook-mock__timer" role="timer" aria-live="off"></strong></p>' +
      '<p class="handbook-mock__summary" role="status"></p>' +
      '<div class="handbook-mock__card admonition question" hidden>' +
      '<p class="admonition-title handbook-mock__title"></p>' +
      '<p><strong class="handbook-mock__followup"></strong></p><p class="handbook-mock__question"></p>' +
      '<p><label>Your answer <input type="number" step="any" class="handbook-mock__answer" ' +
      'style="border: 1px solid currentColor; border-radius: 2px; padding: 0.2em 0.4em"></label> ' +
      '<span class="handbook-mock__unit"></span> ' +
      '<button type="button" class="md-button handbook-mock__check">Check</button></p>' +
      '<div class="handbook-mock__reveal" hidden>' +
      '<p role="status"><span class="handbook-mock__verdict"></span> Answer: ' +
      '<strong class="handbook-mock__expected"></strong></p>' +
      '<p>Worked: <code class="handbook-mock__formula"></code></p>' +
      '<p><button type="button" class="md-button handbook-mock__knew">Knew it</button> ' +
      '<button type="button" class="md-button handbook-mock__again">Review again</button></p></div></div>' +
      '<p><strong>Review list</strong> (questions marked "Review again" here and on the hard-questions ' +
      'pages):</p><ul class="handbook-mock__review"></ul>';
    host.querySelector(".handbook-mock__start").addEventListener("click", function () { start(host); });
    host.querySelector(".handbook-mock__stop").addEventListener("click", function () {
      if (state && !state.done) finish(host, "Stopped.");
    });
    host.querySelector(".handbook-mock__check").addEventListener("click", function () { check(host); });
    host.querySelector(".handbook-mock__answer").addEventListener("keydown", function (event) {
      if (event.key === "Enter") check(host);
    });
    host.querySelector(".handbook-mock__knew").addEventListener("click", function () { grade(host, "knew"); });
    host.querySelector(".handbook-mock__again").addEventListener("click", function () { grade(host, "again"); });
    showReviewList(host);
  }

  function setup() {
    var host = document.querySelector(".handbook-mock");
    if (!host || host.dataset.ready) return;
    host.dataset.ready = "loading";
    fetch(DATA_URL).then(function (response) {
      if (!response.ok) throw new Error("HTTP " + response.status + " for " + DATA_URL);
      return response.json();
    }).then(function (data) {
      bank = data;
      render(host);
      host.dataset.ready = "true";
    }).catch(function (err) {
      host.textContent = "The question bank did not load: " + err.message;
    });
  }

  window.handbookMock = {
    seed: function (n) { random = seeded(n); },
    current: function () {
      return state && state.question && { id: state.template.id, params: state.question.params,
        step: state.question.step, answer: state.question.answer };
    },
    answer: function (id, params) { return answer(template(id), params); }
  };

  // Material's instant navigation swaps pages without a reload: re-run on every page.
  if (window.document$) window.document$.subscribe(setup);
  else document.addEventListener("DOMContentLoaded", setup);
})();
