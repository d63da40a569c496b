// egress-agent status page: read-only views of the control API's GET endpoints, and live
// denials from /v1/events/sse. Text only (textContent), never markup from the API.
"use strict";

const MAX_DENIALS = 50;
let policies = {};

function el(tag, text, cls) {
  const e = document.createElement(tag);
  if (text !== undefined && text !== null) e.textContent = String(text);
  if (cls) e.className = cls;
  return e;
}

function badge(name) {
  const b = el("span", name, "badge badge-" + name);
  b.dataset.badge = name;
  return b;
}

async function get(path) {
  const r = await fetch(path, { headers: { accept: "application/json" } });
  if (!r.ok) throw new Error(path + ": " + r.status);
  return r.json();
}

function badgeOf(p) {
  if (!p) return "allowlist";
  if (p.mode === "allow_all" || p.mode === "deny_all") return p.mode;
  return p.enforce === "audit" ? "audit" : "allowlist";
}

function renderSummary(s) {
  const box = document.getElementById("summary");
  box.replaceChildren();
  const items = [
    ["version", s.version],
    ["uptime", s.uptime_s + " s"],
    ["proxy", s.proxy_endpoint],
    ["denials", s.events_total],
  ];
  for (const [k, v] of items) {
    const span = el("span");
    span.append(el("span", k + ": ", "muted"), el("b", v));
    box.append(span);
  }
  const p = el("span", "proxy: checking…", "muted");
  p.id = "proxy-state";
  box.append(p);
  renderProxyState();
  // What is refused as interception-unavailable: a CA that can't be set up, bindings without
  // their secret (each names its policy, binding and source, never the secret).
  const i = s.interception || {};
  const problems = (i.unavailable_bindings || []).map((b) => b.summary);
  if (i.setup_error) problems.unshift("TLS interception: " + i.setup_error);
  for (const text of problems) {
    const span = el("span");
    span.dataset.interception = "unavailable";
    span.append(el("span", "interception-unavailable: ", "muted"), el("b", text));
    box.append(span);
  }
}

function renderContainers(list) {
  const body = document.querySelector("#containers tbody");
  body.replaceChildren();
  // Docker containers and Kubernetes pods (`kind`: docker | pod; a pod is `namespace/name`).
  const rows = (Array.isArray(list) ? list : []).filter((c) => c.container);
  for (const c of rows) {
    const name = c.container;
    const tr = el("tr");
    tr.dataset.container = name;
    tr.dataset.kind = c.kind || "";
    const badgeName = c.badge || badgeOf(policies[c.policy]);
    tr.append(el("td", name), el("td", c.kind === "pod" ? "pod" : "container"), el("td", c.policy || "-"));
    const td = el("td");
    td.append(badge(badgeName));
    tr.append(td, el("td", c.allowed, "num"), el("td", c.denied, "num"), el("td", c.proxied, "num"));
    body.append(tr);
  }
  document.getElementById("containers-empty").hidden = rows.length > 0;
}

function renderPolicies(all, defaults) {
  const body = document.querySelector("#policies tbody");
  body.replaceChildren();
  for (const [name, p] of Object.entries(all)) {
    const tr = el("tr");
    tr.dataset.policy = name;
    const td = el("td");
    td.append(badge(badgeOf(p)));
    const roles = [];
    if (defaults && defaults.default_policy === name) roles.push("default");
    if (defaults && defaults.unlabeled === name) roles.push("unlabeled");
    const hosts = (p.allow_hosts || []).map((h) => (typeof h === "string" ? h : h.host)).slice(0, 6);
    const cidrs = (p.allow_cidrs || []).map((c) => (typeof c === "string" ? c : c.cidr)).slice(0, 4);
    const allows = p.mode === "allowlist" ? hosts.concat(cidrs).join(", ") || "nothing" : "";
    tr.append(el("td", name), td, el("td", roles.join(", ")), el("td", allows));
    body.append(tr);
  }
}

function denialRow(ev, fresh) {
  const tr = el("tr", null, fresh ? "fresh" : "");
  tr.dataset.reason = ev.reason || "";
  const dest = (ev.host || ev.ip || "?") + ":" + ev.port;
  const ctx = ev.context || {};
  // A pod's events name it `namespace/pod`, and the container when the kernel knew it.
  let who = ev.container ? ev.container.name : ctx.exec || "-";
  if (ctx["k8s.container.name"]) who += " (" + ctx["k8s.container.name"] + ")";
  const t = (ev.time || "").replace("T", " ").replace(/\.\d+Z$/, "Z");
  tr.append(el("td", t), el("td", who), el("td", ev.policy), el("td", dest), el("td", ev.verdict || "deny"), el("td", ev.reason), el("td", ev.rule || "-"));
  return tr;
}

function addDenial(ev, fresh) {
  const body = document.querySelector("#denials tbody");
  body.prepend(denialRow(ev, fresh));
  while (body.children.length > MAX_DENIALS) body.lastElementChild.remove();
  document.getElementById("denials-empty").hidden = true;
}

let proxyCheck = null;

// Whether the proxy is up: the doctor's `proxy.listening` probe.
function renderProxyState() {
  const p = document.getElementById("proxy-state");
  if (!p || !proxyCheck) return;
  const up = proxyCheck.status === "pass";
  p.textContent = up ? "proxy up" : "proxy " + proxyCheck.status + ": " + proxyCheck.summary;
  p.className = up ? "up" : "down";
}

function renderDoctor(checks) {
  proxyCheck = (Array.isArray(checks) ? checks : []).find((c) => c.id === "proxy.listening") || null;
  renderProxyState();
  const body = document.querySelector("#doctor tbody");
  body.replaceChildren();
  for (const c of Array.isArray(checks) ? checks : []) {
    const tr = el("tr");
    tr.dataset.probe = c.id;
    tr.append(el("td", c.id), el("td", c.status, "status-" + c.status), el("td", c.summary));
    body.append(tr);
  }
}

async function refresh() {
  try {
    const [status, pols, defaults] = await Promise.all([get("/v1/status"), get("/v1/policies"), get("/v1/defaults").catch(() => null)]);
    policies = pols;
    renderSummary(status);
    renderPolicies(pols, defaults);
    renderContainers(await get("/v1/containers"));
  } catch (e) {
    document.getElementById("summary").textContent = "the daemon did not answer: " + e.message;
  }
}

function live() {
  const badgeEl = document.getElementById("live");
  const src = new EventSource("/v1/events/sse");
  src.onopen = () => { badgeEl.className = "live-on"; };
  src.onerror = () => { badgeEl.className = "live-off"; };
  src.addEventListener("denial", (m) => {
    try {
      const ev = JSON.parse(m.data);
      if (ev.lagged) return;
      addDenial(ev, true);
    } catch (_) { /* not an event */ }
  });
}

async function start() {
  await refresh();
  try {
    for (const ev of await get("/v1/events?n=" + MAX_DENIALS)) addDenial(ev, false);
  } catch (_) { /* shown by refresh */ }
  live();
  get("/v1/doctor").then(renderDoctor).catch(() => {});
  setInterval(refresh, 5000);
}

document.addEventListener("DOMContentLoaded", start);
