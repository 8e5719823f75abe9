// Self-test on the hard-questions pages. Answers stay folded until you open them; after
// reading one, mark it "Knew it" or "Review again". The marks live in this browser's
// localStorage, so progress survives reloads; nothing leaves the machine.
(function () {
  "use strict";

  const PREFIX = "handbook-quiz:";
  const LABELS = { knew: "Knew it", again: "Review again" };

  function question(details) {
    return details.querySelector("summary").textContent.trim();
  }

  function storageKey(details) {
    return PREFIX + location.pathname + "#" + question(details);
  }

  function read(details) {
    try {
      return localStorage.getItem(storageKey(details));
    } catch (err) {
      return null; // storage disabled (private mode): the quiz still works for this visit
    }
  }

  // The mark lives in three places: storage, the border the CSS draws from data-quiz, and
  // the pressed state a screen reader announces on the two buttons.
  function write(details, value) {
    try {
      if (value) localStorage.setItem(storageKey(details), value);
      else localStorage.removeItem(storageKey(details));
    } catch (err) {
      /* storage disabled: keep the mark on the page only */
    }
    details.dataset.quiz = value || "";
    details.querySelectorAll(".handbook-quiz__actions button").forEach((button) => {
      button.setAttribute("aria-pressed", String(button.dataset.mark === value));
    });
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

    // role=status: screen readers read the new tally politely after each mark.
    const bar = document.createElement("div");
    bar.className = "handbook-quiz";
    bar.innerHTML =
      '<span class="handbook-quiz__count" role="status"></span> ' +
      '<button type="button" class="md-button handbook-quiz__hide" aria-pressed="false">Hide known</button> ' +
      '<button type="button" class="md-button handbook-quiz__reset">Reset</button>';
    questions[0].parentNode.insertBefore(bar, questions[0].previousElementSibling || questions[0]);

    questions.forEach((details) => {
      const actions = document.createElement("p");
      actions.className = "handbook-quiz__actions";
      Object.entries(LABELS).forEach(([value, label]) => {
        const button = document.createElement("button");
        button.type = "button";
        button.className = "md-button handbook-quiz__" + value;
        button.dataset.mark = value;
        button.textContent = label;
        // Thirty-odd buttons read "Knew it": the name carries its question.
        button.setAttribute("aria-label", `${label}: ${question(details)}`);
        button.addEventListener("click", () => {
          write(details, value);
          details.open = false;
          // The button just folded away; focus goes back to its question, not to <body>.
          details.querySelector("summary").focus();
          summarize(questions, bar);
        });
        actions.appendChild(button);
      });
      details.appendChild(actions);
      write(details, read(details) || "");
    });

    bar.querySelector(".handbook-quiz__reset").addEventListener("click", () => {
      questions.forEach((details) => write(details, ""));
      summarize(questions, bar);
    });
    bar.querySelector(".handbook-quiz__hide").addEventListener("click", (event) => {
      const hiding = article.classList.toggle("handbook-quiz--hide-known");
      event.currentTarget.setAttribute("aria-pressed", String(hiding));
    });
    summarize(questions, bar);
  }

  // Material's instant navigation swaps pages without a reload: re-run on every page.
  if (window.document$) window.document$.subscribe(setup);
  else document.addEventListener("DOMContentLoaded", setup);
})();
