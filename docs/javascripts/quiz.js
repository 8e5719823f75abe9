// Self-test on the hard-questions pages. Answers stay folded until you open them; after
// reading one, mark it "Knew it" or "Review again". The marks live in this browser's
// localStorage, so progress survives reloads; nothing leaves the machine.
(function () {
  "use strict";

  const PREFIX = "handbook-quiz:";
  const LABELS = { knew: "Knew it", again: "Review again" };

  function storageKey(details) {
    const summary = details.querySelector("summary");
    return PREFIX + location.pathname + "#" + summary.textContent.trim();
  }

  function read(details) {
    try {
      return localStorage.getItem(storageKey(details));
    } catch (err) {
      return null; // storage disabled (private mode): the quiz still works for this visit
    }
  }

  function write(details, value) {
    try {
      if (value) localStorage.setItem(storageKey(details), value);
      else localStorage.removeItem(storageKey(details));
    } catch (err) {
      /* storage disabled: keep the mark on the page only */
    }
    details.dataset.quiz = value || "";
  }

  function summarize(questions, bar) {
    const marks = questions.map((q) => q.dataset.quiz);
    const knew = marks.filter((m) => m === "knew").length;
    const again = marks.filter((m) => m === "again").length;
    bar.querySelector(".handbook-quiz__count").textContent =
      `${knew} known · ${again} to review · ${questions.length - knew - again} not tried, of ${questions.length}`;
  }

  function setup() {
    const article = document.querySelector("article");
    if (!article || article.querySelector(".handbook-quiz")) return;
    const questions = Array.from(article.querySelectorAll("details.question"));
    if (!questions.length) return;

    const bar = document.createElement("div");
    bar.className = "handbook-quiz";
    bar.innerHTML =
      '<span class="handbook-quiz__count"></span> ' +
      '<button type="button" class="md-button handbook-quiz__hide">Hide known</button> ' +
      '<button type="button" class="md-button handbook-quiz__reset">Reset</button>';
    questions[0].parentNode.insertBefore(bar, questions[0].previousElementSibling || questions[0]);

    questions.forEach((details) => {
      details.dataset.quiz = read(details) || "";
      const actions = document.createElement("p");
      actions.className = "handbook-quiz__actions";
      Object.entries(LABELS).forEach(([value, label]) => {
        const button = document.createElement("button");
        button.type = "button";
        button.className = "md-button handbook-quiz__" + value;
        button.textContent = label;
        button.addEventListener("click", () => {
          write(details, value);
          details.open = false;
          summarize(questions, bar);
        });
        actions.appendChild(button);
      });
      details.appendChild(actions);
    });

    bar.querySelector(".handbook-quiz__reset").addEventListener("click", () => {
      questions.forEach((details) => write(details, ""));
      summarize(questions, bar);
    });
    bar.querySelector(".handbook-quiz__hide").addEventListener("click", (event) => {
      const hiding = article.classList.toggle("handbook-quiz--hide-known");
      event.target.textContent = hiding ? "Show known" : "Hide known";
    });
    summarize(questions, bar);
  }

  // Material's instant navigation swaps pages without a reload: re-run on every page.
  if (window.document$) window.document$.subscribe(setup);
  else document.addEventListener("DOMContentLoaded", setup);
})();
