// Diagrams without the 3.5 MB Mermaid bundle on the first screen.
//
// The theme renders each diagram (`pre.mermaid`) by calling `mermaid.initialize` once, then
// `mermaid.render(id, text)`; when no global `mermaid` exists it fetches one from a CDN,
// which the offline site must never do. So this script defines that global as a stand-in:
// it keeps the theme's settings, and each render waits until its diagram is within MARGIN
// of the viewport, then loads the vendored bundle (once, for every diagram) and hands over.
// The bundle replaces the global when it loads, so later renders go to it directly.
//
// Every page loads this script, so that the stand-in is there when instant navigation brings
// the reader to a page with diagrams. mermaid2 adds it a second time to a page that has a
// diagram, in place of the bundle; that run returns at once.
(() => {
  // The second run on a page with a diagram. (A page element with id="mermaid" is also
  // `window.mermaid`; the theme, too, tells the two apart.)
  if (window.mermaid && !(window.mermaid instanceof Element)) return;

  const BUNDLE = new URL("vendor/mermaid-11.17.2.min.js", document.currentScript.src).href;
  // Half a screen ahead: the bundle arrives while the reader scrolls toward the diagram,
  // and the first screen of a page whose first diagram is lower down never asks for it.
  const MARGIN = "50% 0px";

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

  // Resolves once the code block holding `text` comes near the viewport. The theme passes
  // only the text; its block stays in the page until the render resolves.
  const near = (text) => new Promise((resolve) => {
    const block = Array.from(document.querySelectorAll("pre"))
      .find((pre) => !claimed.has(pre) && pre.textContent === text);
    if (!block) {
      resolve();
      return;
    }
    claimed.add(block);
    const observer = new IntersectionObserver((entries) => {
      if (entries.some((entry) => entry.isIntersecting)) {
        observer.disconnect();
        resolve();
      }
    }, {rootMargin: MARGIN});
    observer.observe(block);
  });

  window.mermaid = {
    initialize(config) {
      settings = config;
    },
    async render(id, text) {
      await near(text);
      return (await load()).render(id, text);
    },
  };
})();
