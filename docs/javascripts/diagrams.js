// Diagrams without the 3.5 MB Mermaid bundle.
//
// The theme renders each diagram (`pre.mermaid`) by calling `mermaid.initialize` once, then
// `mermaid.render(id, text)`; when no global `mermaid` exists it fetches one from a CDN,
// which the offline site must never do. So this script defines that global as a stand-in.
// Each render waits until its diagram is within MARGIN of the viewport. A diagram drawn
// ahead of time (`data-diagram="KEY"`, set by docs/hooks/diagrams.py) then gets its SVG from
// diagrams/KEY.svg, a few kilobytes (on a narrow screen, its top-to-bottom turn where the
// hook named one, `data-diagram-narrow`). Any other diagram (one edited since its SVG was drawn)
// loads the vendored bundle (once, for every such diagram) with the theme's settings, and
// the bundle replaces the global when it loads, so later renders go to it directly.
//
// A diagram sits in a frame (docs/hooks/diagrams.py) that scrolls sideways where the screen
// is too narrow to show it legibly (docs/stylesheets/extra.css). A frame that scrolls is
// marked, which shows its hint, and becomes a keyboard stop, so arrow keys scroll it too.
//
// Every page loads this script, so that the stand-in is there when instant navigation brings
// the reader to a page with diagrams. mermaid2 adds it a second time to a page that has a
// diagram, in place of the bundle; that run returns at once.
(() => {
  // The second run on a page with a diagram. (A page element with id="mermaid" is also
  // `window.mermaid`; the theme, too, tells the two apart.)
  if (window.mermaid && !(window.mermaid instanceof Element)) return;

  const BUNDLE = new URL("vendor/mermaid-11.17.2.min.js", document.currentScript.src).href;
  const DRAWN = new URL("../diagrams/", document.currentScript.src).href;
  // The id the stored SVGs were drawn with (scripts/render_diagrams.py); each render swaps
  // in the theme's id, as Mermaid would have written it.
  const DRAWN_ID = "__mermaid_drawn";
  // Half a screen ahead: the bundle arrives while the reader scrolls toward the diagram,
  // and the first screen of a page whose first diagram is lower down never asks for it.
  const MARGIN = "50% 0px";
  // On paper a diagram is at most 120 mm tall (it keeps its aspect ratio): a tall one
  // printed at the page's width would fill a page of its own, or leave the page before it
  // half empty. The theme puts the SVG into the diagram's shadow root, where the site's
  // stylesheet does not reach, so the rule travels with each stored SVG. (A diagram the
  // bundle draws, one edited since its SVG was stored, prints uncapped until it is redrawn.)
  // It follows the SVG, so the drawing stays the shadow root's first element.
  const PRINT_SIZE = "<style>@media print { svg { max-height: 120mm; } }</style>";

  let settings;
  let bundle;
  const claimed = new WeakSet();

  const load = () => (bundle ||= new Promise((resolve, reject) => {
    const script = document.createElement("script");
    script.src = BUNDLE;
    script.onload = () => {
      window.mermaid.initialize(settings);
      resolve(window.mermaid);
    };
    script.onerror = () => reject(new Error(`Mermaid did not load from ${BUNDLE}`));
    document.head.appendChild(script);
  }));

  // Resolves with the code block holding `text` once it comes near the viewport. The theme
  // passes only the text; its block stays in the page until the render resolves.
  const near = (text) => new Promise((resolve) => {
    const block = Array.from(document.querySelectorAll("pre"))
      .find((pre) => !claimed.has(pre) && pre.textContent === text);
    if (!block) {
      resolve(null);
      return;
    }
    claimed.add(block);
    const observer = new IntersectionObserver((entries) => {
      if (entries.some((entry) => entry.isIntersecting)) {
        observer.disconnect();
        resolve(block);
      }
    }, {rootMargin: MARGIN});
    observer.observe(block);
  });

  const mark = (frame) => {
    const scrolls = frame.scrollWidth > frame.clientWidth + 1;
    frame.toggleAttribute("data-scrolls", scrolls);
    if (scrolls) {
      frame.tabIndex = 0;
      frame.setAttribute("role", "group");
      frame.setAttribute("aria-label", "Diagram, scrolls sideways");
    } else {
      for (const name of ["tabindex", "role", "aria-label"]) frame.removeAttribute(name);
    }
  };
  // Called on a frame when it is first observed and whenever its width changes (a turned phone).
  const frames = new ResizeObserver((entries) => entries.forEach((entry) => mark(entry.target)));
  const watchFrames = () => document.querySelectorAll(".diagram-frame").forEach((frame) => frames.observe(frame));
  // Instant navigation announces each new page on the theme's document$; without it, load.
  if (window.document$) window.document$.subscribe(watchFrames);
  else document.addEventListener("DOMContentLoaded", watchFrames);

  window.mermaid = {
    initialize(config) {
      settings = config;
    },
    async render(id, text) {
      const block = await near(text);
      // Where the stylesheet gives this screen the top-to-bottom turn, fetch that drawing.
      const narrow = block && getComputedStyle(block).getPropertyValue("--diagram-variant").trim() === "narrow";
      const key = (narrow && block.dataset.diagramNarrow) || block?.dataset.diagram;
      if (key) {
        const response = await fetch(`${DRAWN}${key}.svg`);
        if (response.ok) return {svg: (await response.text()).replaceAll(DRAWN_ID, id) + PRINT_SIZE};
      }
      return (await load()).render(id, text);
    },
  };
})();
