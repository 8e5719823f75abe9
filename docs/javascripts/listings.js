// Syntax colours on long pages, put in as each listing comes near the viewport.
//
// On a page with thousands of token spans the build (docs/hooks/handbook.py, on_post_page)
// shows every listing after the first as plain text and keeps its coloured spans in an
// inert <template> right after it. A template's content takes no part in style or layout,
// so a phone lays out the page's first screen, and every forced layout after it, over a
// fraction of the elements. This script moves the spans in a screen before the reader
// gets there. The text is the same either way, so nothing moves on screen; without
// scripts the listings stay plain text.
(() => {
  const MARGIN = "100% 0px";
  const SELECTOR = "template.handbook-colours";

  const paint = (pre) => {
    const template = pre.nextElementSibling;
    const code = pre.querySelector("code");
    if (!template || !template.matches(SELECTOR) || !code) return;
    code.innerHTML = template.innerHTML;
    template.remove();
  };

  const observer = "IntersectionObserver" in window ? new IntersectionObserver((entries) => {
    for (const entry of entries) {
      if (entry.isIntersecting) {
        observer.unobserve(entry.target);
        paint(entry.target);
      }
    }
  }, {rootMargin: MARGIN}) : null;

  const watch = () => {
    for (const template of document.querySelectorAll(SELECTOR)) {
      const pre = template.previousElementSibling;
      if (pre) observer ? observer.observe(pre) : paint(pre);
    }
  };

  // With navigation.instant the theme swaps pages without rerunning scripts and announces
  // each new one on document$; without it, DOMContentLoaded.
  if (window.document$ && typeof window.document$.subscribe === "function") {
    window.document$.subscribe(watch);
  } else if (document.readyState === "loading") {
    document.addEventListener("DOMContentLoaded", watch);
  } else {
    watch();
  }
})();
