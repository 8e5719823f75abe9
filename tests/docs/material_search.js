// Runs the theme's own search worker (lunr, as the built site ships it) in Node on the built
// index and prints, for each query, the result pages in the order the search dialog lists them.
// usage: node material_search.js WORKER.js search_index.json QUERY...
"use strict";
const fs = require("fs");
const vm = require("vm");

const [worker, indexPath, ...queries] = process.argv.slice(2);
const listeners = [];
const replies = [];
const scope = {
  console, setTimeout, clearTimeout, Promise,
  postMessage: message => replies.push(message),
  importScripts: () => {},  // only non-English stemmers are imported; the site is English
  addEventListener: (_type, listener) => listeners.push(listener),
};
scope.self = scope;
vm.createContext(scope);
vm.runInContext(fs.readFileSync(worker, "utf8"), scope);

// The worker answers each message with one postMessage, asynchronously.
function send(data) {
  const before = replies.length;
  listeners.forEach(listener => listener({data}));
  return new Promise(resolve => {
    const poll = () => (replies.length > before ? resolve(replies[before]) : setTimeout(poll, 1));
    poll();
  });
}

(async () => {
  const index = JSON.parse(fs.readFileSync(indexPath, "utf8"));
  // 0: set-up with the index (the page passes its search.suggest feature flag), 2: a query.
  await send({type: 0, data: {...index, options: {suggest: true}}});
  const ranked = {};
  for (const query of queries) {
    const reply = await send({type: 2, data: query});
    // Items come grouped by page, best group first; a group's first entry is what is shown first.
    ranked[query] = reply.data.items.map(group => group[0].location);
  }
  process.stdout.write(JSON.stringify(ranked));
})();
