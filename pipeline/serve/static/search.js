// The search page of `newsvec serve` (pipeline/serve/search_page.py serves it): the form, the
// service's POST /v1/search and GET /info, from the same origin. What an article holds goes into
// the page as text (textContent), never as markup, and a link only to an http(s) address. The
// page's Content-Security-Policy runs this file alone: no inline script, nothing remote.
"use strict";

(function () {
  const KEY_STORE = "newsvec.apiKey"; // sessionStorage: this tab only, gone when it closes
  const STORIES = 10; // stories shown
  const ARTICLES = 100; // articles asked for, every copy of a story among them (all_copies)
  const FIELDS = ["q", "source", "language", "from", "to"];

  const byId = (id) => document.getElementById(id);
  const form = byId("search-form");
  const query = byId("q");
  const results = byId("results");
  const statusLine = byId("status");
  const errorBox = byId("error");
  const keyBox = byId("key-box");
  const keyInput = byId("key");
  const keyReason = byId("key-reason");
  const about = byId("about");
  const filtersNote = byId("filters-note");
  const filtersBox = byId("filters-box");
  const FILTERS = ["source", "language", "from", "to"];

  function storedKey() {
    try {
      return sessionStorage.getItem(KEY_STORE) || "";
    } catch (e) {
      return "";
    }
  }

  function storeKey(key) {
    try {
      if (key) sessionStorage.setItem(KEY_STORE, key);
      else sessionStorage.removeItem(KEY_STORE);
    } catch (e) {
      // storage refused (a private window's policy): the key lasts until the page is left
    }
  }

  class Refusal extends Error {
    constructor(status, error, message) {
      super(message || (error && error.message) || "status " + status);
      this.status = status;
      this.code = error && error.code;
    }
  }

  // The service's answer to GET path, or POST path with a JSON body; a Refusal when it refuses.
  async function call(path, body) {
    const headers = { Accept: "application/json" };
    const key = storedKey();
    if (key) headers.Authorization = "Bearer " + key;
    const init = { method: "GET", headers: headers, cache: "no-store", credentials: "omit" };
    if (body !== undefined) {
      init.method = "POST";
      headers["Content-Type"] = "application/json";
      init.body = JSON.stringify(body);
    }
    let response;
    try {
      response = await fetch(path, init);
    } catch (e) {
      throw new Refusal(0, null, "the service cannot be reached (" + e.message + ")");
    }
    let data = null;
    try {
      data = await response.json();
    } catch (e) {
      data = null;
    }
    if (!response.ok) throw new Refusal(response.status, data && data.error);
    return data;
  }

  // An element holding text (never parsed as markup).
  function node(tag, text, className) {
    const element = document.createElement(tag);
    if (text !== undefined && text !== null) element.textContent = String(text);
    if (className) element.className = className;
    return element;
  }

  function safeHref(url) {
    if (typeof url !== "string") return null;
    try {
      const parsed = new URL(url);
      return parsed.protocol === "https:" || parsed.protocol === "http:" ? parsed.href : null;
    } catch (e) {
      return null;
    }
  }

  function shownTime(iso) {
    const when = new Date(iso);
    if (Number.isNaN(when.getTime())) return String(iso);
    return when.toISOString().slice(0, 16).replace("T", " ") + " UTC";
  }

  function titleOf(hit, tag) {
    const heading = node(tag, null, "title");
    const text = hit.title || "(no title)";
    const href = safeHref(hit.url);
    const target = node(href ? "a" : "span", text);
    if (href) {
      target.href = href;
      target.rel = "noopener noreferrer";
    }
    if (typeof hit.language === "string" && hit.language) target.lang = hit.language;
    heading.append(target);
    return heading;
  }

  function metaOf(hit) {
    const parts = [];
    if (hit.source) parts.push(node("span", hit.source, "source"));
    if (hit.published_at) {
      const time = node("time", shownTime(hit.published_at));
      time.dateTime = hit.published_at;
      parts.push(time);
    }
    if (typeof hit.score === "number") parts.push(node("span", "score " + hit.score.toFixed(3)));
    if (hit.url && !safeHref(hit.url)) parts.push(node("span", "address (not a link): " + hit.url));
    const meta = node("p", null, "meta");
    parts.forEach((part, i) => {
      if (i) meta.append(" · ");
      meta.append(part);
    });
    return meta;
  }

  // The hits grouped by story (story_id, else the article's id), in the order of each story's
  // best hit (the hits come best first).
  function stories(hits) {
    const order = [];
    const byStory = new Map();
    for (const hit of hits) {
      const story = hit.story_id || hit.id;
      if (!byStory.has(story)) {
        byStory.set(story, []);
        order.push(story);
      }
      byStory.get(story).push(hit);
    }
    return order.map((story) => byStory.get(story));
  }

  function plural(n, one, many) {
    return n + " " + (n === 1 ? one : many);
  }

  function storyItem(hits) {
    const best = hits[0];
    const others = hits.slice(1);
    const item = node("li", null, "story");
    item.append(titleOf(best, "h2"), metaOf(best));
    const copies = Math.max(best.copies || 0, others.length);
    if (copies > 0) {
      const details = node("details", null, "copies");
      details.append(node("summary", plural(copies, "other copy", "other copies")));
      const list = node("ul");
      for (const hit of others) {
        const copy = node("li");
        copy.append(titleOf(hit, "h3"), metaOf(hit));
        list.append(copy);
      }
      const unseen = copies - others.length;
      if (unseen > 0) {
        list.append(node("li", plural(unseen, "more", "more") +
          ": not among the nearest articles, or left out by the filters", "note"));
      }
      details.append(list);
      item.append(details);
    }
    return item;
  }

  function commaList(id) {
    return byId(id).value.split(",").map((s) => s.trim()).filter(Boolean);
  }

  // The filters of /v1/search from the form's fields: "to" is a whole day (UTC), so the search
  // keeps what was published before the next day.
  function filters() {
    const chosen = {};
    const sources = commaList("source");
    const languages = commaList("language");
    if (sources.length) chosen.source = sources;
    if (languages.length) chosen.language = languages;
    const from = byId("from").value;
    const to = byId("to").value;
    if (from) chosen.published_after = from + "T00:00:00Z";
    if (to) {
      const next = new Date(to + "T00:00:00Z");
      next.setUTCDate(next.getUTCDate() + 1);
      chosen.published_before = next.toISOString().slice(0, 10) + "T00:00:00Z";
    }
    if (from && to && from > to) throw new Refusal(400, null, "“From” is after “To”.");
    return chosen;
  }

  function showError(title, detail, action) {
    errorBox.replaceChildren();
    if (!title) {
      errorBox.hidden = true;
      return;
    }
    errorBox.append(node("strong", title));
    if (detail) errorBox.append(node("p", detail));
    if (action) errorBox.append(action);
    errorBox.hidden = false;
  }

  function askForKey(reason, focus) {
    keyReason.textContent = reason;
    keyReason.hidden = false;
    keyBox.hidden = false;
    keyBox.open = true;
    if (focus) keyInput.focus();
  }

  // The summary of the filters says how many are set (they may be folded away).
  function countFilters() {
    const set = FILTERS.filter((id) => byId(id).value.trim()).length;
    byId("filters-set").textContent = set ? "(" + set + " set)" : "";
    return set;
  }

  function clearFilters() {
    for (const id of FILTERS) byId(id).value = "";
    countFilters();
  }

  function refused(error) {
    if (error.status === 401) {
      const reason = storedKey() ? "The service refused this key: enter the right one."
        : "This service needs an API key: enter it below.";
      showError(reason);
      askForKey(reason, true);
      return;
    }
    if (error.code === "unsupported_filter") {
      const retry = node("button", "Clear the filters and search again");
      retry.type = "button";
      retry.addEventListener("click", () => {
        clearFilters();
        search();
      });
      filtersBox.open = true;
      showError("This service's search takes no filters.", error.message, retry);
      return;
    }
    const title = error.status === 0 ? "The service cannot be reached."
      : error.status === 429 ? "The service is busy: try again in a moment."
        : error.status >= 500 ? "The service cannot answer now."
          : "The search was refused.";
    showError(title, error.message);
  }

  let latest = 0;

  async function search() {
    const text = query.value.trim();
    if (!text) {
      query.focus();
      return;
    }
    const run = ++latest;
    showError(null);
    statusLine.textContent = "Searching…";
    results.setAttribute("aria-busy", "true");
    try {
      const body = Object.assign({ query: text, k: ARTICLES, all_copies: true }, filters());
      const answer = await call("v1/search", body);
      if (run !== latest) return; // a newer search answers
      const found = stories(answer.data || []).slice(0, STORIES);
      results.replaceChildren(...found.map(storyItem));
      statusLine.textContent = found.length
        ? plural(found.length, "story", "stories") + " for “" + text + "”"
        : "Nothing found for “" + text + "”.";
    } catch (error) {
      if (run !== latest) return;
      results.replaceChildren();
      statusLine.textContent = "";
      refused(error);
    } finally {
      if (run === latest) results.removeAttribute("aria-busy");
    }
  }

  function addCode(parent, text) {
    parent.append(node("code", text));
  }

  async function loadAbout() {
    try {
      const info = await call("info");
      const model = info.model || {};
      about.replaceChildren("Embedding model ");
      addCode(about, model.label || model.name || "?");
      about.append(" · searching ");
      addCode(about, info.output || "?");
      about.append(" (" + info.search + ")");
      const run = info.output_run && info.output_run.run_id;
      if (run) {
        about.append(" · run ");
        addCode(about, run);
      }
      filtersNote.textContent = info.search === "store"
        ? "This service searches the store, whose search takes no filters." : "";
      filtersNote.hidden = info.search !== "store";
    } catch (error) {
      about.textContent = error.status === 401
        ? "Enter the API key to see the model and the output this service searches."
        : "What this service serves could not be read: " + error.message;
      if (error.status === 401) askForKey("This service needs an API key: enter it below.", false);
    }
  }

  // The form's fields in the address (never the key), so that a search can be shared or
  // bookmarked; and back from it.
  function fromAddress() {
    const params = new URLSearchParams(window.location.search);
    for (const id of FIELDS) byId(id).value = params.get(id) || "";
    if (countFilters()) filtersBox.open = true;
  }

  function toAddress() {
    const params = new URLSearchParams();
    for (const id of FIELDS) {
      const value = byId(id).value.trim();
      if (value) params.set(id, value);
    }
    const address = "?" + params.toString();
    if (address !== window.location.search) window.history.pushState(null, "", address);
  }

  form.addEventListener("submit", (event) => {
    event.preventDefault();
    toAddress();
    search();
  });

  byId("key-form").addEventListener("submit", (event) => {
    event.preventDefault();
    storeKey(keyInput.value.trim());
    keyInput.value = "";
    keyReason.hidden = true;
    keyBox.open = false;
    showError(null);
    query.focus();
    loadAbout();
    if (query.value.trim()) search();
  });

  byId("forget-key").addEventListener("click", () => {
    storeKey("");
    keyInput.value = "";
    statusLine.textContent = "The key is forgotten.";
  });

  window.addEventListener("popstate", () => {
    fromAddress();
    if (query.value.trim()) search();
    else results.replaceChildren();
  });

  for (const id of FILTERS) byId(id).addEventListener("input", countFilters);

  // The filters open where there is room for them, folded on a phone until asked for.
  filtersBox.open = window.matchMedia("(min-width: 40rem)").matches;
  keyBox.hidden = !storedKey(); // shown once the service asks for a key, or one is kept
  fromAddress();
  loadAbout();
  if (query.value.trim()) search();
})();
