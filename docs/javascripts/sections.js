// A link to a heading lands on the heading on a page whose text is drawn only near the screen.
//
// docs/hooks/sections.py puts the text between two headings in blocks that the browser
// draws when they come near the viewport, holding an estimated room until then. A link to
// a heading scrolls there while the blocks around it still hold their estimates; a frame
// later they are drawn at their real size, and the browser keeps the block at the top of
// the screen in place, not the heading, which moves by the difference. So after the
// browser's own scroll this script scrolls the heading back into place, frame by frame,
// until it stays put (a few frames), and stops at once if the reader scrolls or types.
(() => {
  const STABLE_FRAMES = 3;
  const MOST_FRAMES = 60;
  const INPUT = ["wheel", "touchstart", "keydown", "pointerdown"];

  const settle = () => {
    if (!location.hash || !document.querySelector(".handbook-section")) return;
    let target;
    try {
      target = document.getElementById(decodeURIComponent(location.hash.slice(1)));
    } catch {
      return;  // a malformed escape in the address: no heading to keep in place
    }
    if (!target) return;
    let frames = 0;
    let stable = 0;
    let stopped = false;
    const stop = () => {
      stopped = true;
    };
    INPUT.forEach((type) => addEventListener(type, stop, {once: true, passive: true}));
    const step = () => {
      const wanted = parseFloat(getComputedStyle(target).scrollMarginTop) || 0;
      const off = Math.abs(target.getBoundingClientRect().top - wanted) > 1;
      stable = off ? 0 : stable + 1;
      if (stopped || stable >= STABLE_FRAMES || ++frames > MOST_FRAMES) {
        INPUT.forEach((type) => removeEventListener(type, stop));
        return;
      }
      if (off) target.scrollIntoView({behavior: "instant"});
      requestAnimationFrame(step);
    };
    requestAnimationFrame(step);
  };

  // Material's instant navigation announces each new page on document$ (the first one too).
  if (window.document$) window.document$.subscribe(settle);
  else addEventListener("load", settle);
  addEventListener("hashchange", settle);
})();
