// egress-agent console: views of the control API's GET endpoints, live denials from
// /v1/events/sse, and — once signed in — changes: every one previewed as a diff (the API's
// dry run, validated by the agent's own loader) before it is applied, with the session's CSRF
// token on every write. Text only (textContent), never markup from the API.
"use strict";

const MAX_DENIALS = 50;
let policies = {};
let defaults = null;
let containers = [];
let who = null; // GET /v1/session: {via, name, csrf, write} or null
let pending = null; // the change on show: {dry, apply, method, body, replay}
let editing = null; // the policy in the editor: {name, base}

function el(tag, text, cls) {
  const e = document.createElement(tag);
  if (text !== undefined && text !== null) e.textContent = String(text);
  if (cls) e.className = cls;
  return e;
}

function button(text, onclick, cls) {
  const b = el("button", text, cls);
  b.type = "button";
  b.addEventListener("click", onclick);
  return b;
}

function $(id) {
  return document.getElementById(id);
}

function canWrite() {
  return !!(who && who.write);
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

// A write: JSON (or `type`: a bundle's own text) in, JSON out, the session's CSRF token in
// its header.
async function send(method, path, body, type) {
  const headers = { accept: "application/json" };
  if (body !== undefined) headers["content-type"] = type || "application/json";
  if (who && who.csrf) headers["x-egress-csrf"] = who.csrf;
  const init = { method, headers };
  if (body !== undefined) init.body = typeof body === "string" ? body : JSON.stringify(body);
  const r = await fetch(path, init);
  let v = null;
  try {
    v = await r.json();
  } catch (_) { /* no body */ }
  return { ok: r.ok, status: r.status, body: v || {} };
}

// Why the API can't change a policy (built-in, the main file's, a ConfigMap), from
// /v1/defaults' `editable`; null when it can.
function readOnly(name) {
  const e = defaults && defaults.editable && defaults.editable.policies[name];
  return e ? e.read_only : null;
}

function newPoliciesReadOnly() {
  return defaults && defaults.editable ? defaults.editable.new_policies.read_only : null;
}

// The reason as a small marker (its text on hover and for screen readers).
function readOnlyMark(why) {
  const m = el("span", "read-only", "ro");
  m.title = why;
  m.setAttribute("aria-label", "read-only: " + why);
  return m;
}

function badgeOf(p) {
  if (!p) return "allowlist";
  if (p.mode === "allow_all" || p.mode === "deny_all") return p.mode;
  return p.enforce === "audit" ? "audit" : "allowlist";
}

// ---- who is looking: sign in, sign out ----

async function loadSession() {
  let v = {};
  let ok = false;
  try {
    const r = await fetch("/v1/session", { headers: { accept: "application/json" } });
    ok = r.ok;
    v = await r.json();
  } catch (_) { /* shown below */ }
  who = ok ? v : null;
  document.body.classList.toggle("can-write", canWrite());
  renderAuth(ok ? null : v);
}

function renderAuth(refusal) {
  const box = $("auth");
  box.replaceChildren();
  if (who && who.via === "session") {
    box.append(el("span", "signed in as "), el("b", who.name));
    box.dataset.auth = "session";
    box.append(button("Sign out", signOut));
    return;
  }
  if (who) {
    box.dataset.auth = who.via;
    box.append(el("span", who.write ? "root on the control socket" : "read-only", "muted"));
    return;
  }
  box.dataset.auth = "none";
  const input = el("input");
  input.type = "password";
  input.id = "token";
  input.placeholder = "console token";
  input.autocomplete = "off";
  input.addEventListener("keydown", (e) => {
    if (e.key === "Enter") signIn();
  });
  box.append(input, button("Sign in", signIn));
  const note = el("span", "", "muted");
  note.id = "auth-note";
  if (refusal && refusal.tokens === false) {
    note.textContent = "no console token exists yet: run `egress-agent console token NAME` as root on the host";
  } else if (refusal && refusal.read === false) {
    note.textContent = "sign in to see this host";
  } else {
    note.textContent = "sign in to change policies";
  }
  box.append(note);
}

async function signIn() {
  const token = $("token").value.trim();
  const r = await send("POST", "/v1/session", { token });
  if (!r.ok) {
    $("auth-note").textContent = r.body.error || "sign-in refused (" + r.status + ")";
    $("auth-note").className = "error";
    return;
  }
  await loadSession();
  await refresh();
}

async function signOut() {
  await send("DELETE", "/v1/session");
  await loadSession();
  await refresh();
}

// ---- the change panel: a diff before anything is written ----

// Show `title`'s dry run (`dry`), and apply it (`apply`) on request. `replay`: the proposed
// policy `{name, policy}` when the change is a policy's, for "Replay recorded traffic";
// `type`: the body's content type when it is text (an import).
async function propose(title, method, dry, apply, body, replay, type) {
  pending = { method, apply, body, replay, type };
  const panel = $("change");
  panel.hidden = false;
  $("change-title").textContent = title;
  $("change-note").textContent = "Nothing is written until you apply it. Checking…";
  $("change-diff").textContent = "";
  $("change-error").hidden = true;
  $("change-done").hidden = true;
  $("change-replay").hidden = true;
  $("change-replay").replaceChildren();
  $("change-apply").disabled = true;
  $("change-replay-run").hidden = !replay;
  clearFieldErrors();
  const r = await send(method, dry, body, type);
  if (!r.ok) {
    showError(r);
    $("change-note").textContent = "The agent refused this change; nothing was written.";
    return;
  }
  const diff = r.body.diff || "";
  $("change-diff").textContent = diff || "(no change)";
  $("change-note").textContent = r.body.grant
    ? "No file changes: grants " + r.body.grant + "."
    : !diff
      ? "This changes nothing."
      : "The change, as the files will be written (" + (r.body.files || []).join(", ") + "):";
  $("change-apply").disabled = !diff && !r.body.grant;
  panel.scrollIntoView({ block: "start" });
}

function showError(r) {
  const e = $("change-error");
  e.hidden = false;
  e.dataset.status = String(r.status);
  const field = r.body.field || "";
  e.textContent = (r.body.error || "refused (" + r.status + ")");
  // Next to the editor's field it names (`policies.NAME.allow_hosts[1]` → allow_hosts).
  const key = field.replace(/^policies\.[^.]+\.?/, "").replace(/[[.].*$/, "");
  const slot = document.querySelector('.field-error[data-field="' + (key || "name") + '"]');
  if (slot && !$("editor").hidden) slot.textContent = r.body.error || "";
}

function clearFieldErrors() {
  for (const p of document.querySelectorAll(".field-error")) p.textContent = "";
}

async function applyPending() {
  if (!pending) return;
  $("change-apply").disabled = true;
  const r = await send(pending.method, pending.apply, pending.body, pending.type);
  if (!r.ok) {
    showError(r);
    return;
  }
  const after = pending.after || "";
  pending = null;
  for (const id of ["set-default", "set-unlabeled"]) delete $(id).dataset.dirty;
  for (const { ev } of recent) delete ev._selected;
  $("change-done").hidden = false;
  $("change-done").textContent = "Applied: the agent reloaded with it. " + after;
  $("change-note").textContent = "";
  $("editor").hidden = true;
  await refresh();
}

async function replayPending() {
  if (!pending || !pending.replay) return;
  const box = $("change-replay");
  box.hidden = false;
  box.replaceChildren(el("p", "replaying the recorded flows…", "muted"));
  const r = await send("POST", "/v1/replay", pending.replay);
  box.replaceChildren();
  if (!r.ok) {
    box.append(el("p", r.body.error || "replay refused (" + r.status + ")", "error"));
    return;
  }
  const rep = r.body;
  box.append(el("p", "Recorded under " + (pending.replay.name) + ": " + rep.flows + " flows, " + rep.events + " events."));
  const t = el("table");
  t.id = "replay-totals";
  for (const [bucket, c] of Object.entries(rep.totals || {})) {
    const tr = el("tr");
    tr.dataset.bucket = bucket;
    tr.append(el("td", bucket.replace(/_/g, " ")), el("td", c.flows, "num"), el("td", c.events, "num"));
    t.append(tr);
  }
  box.append(t);
  const list = el("ul");
  for (const d of (rep.destinations || []).slice(0, 12)) {
    const li = el("li", d.bucket.replace(/_/g, " ") + ": " + d.destination + " (" + d.flows + " flows, " + d.events + " events)");
    li.dataset.bucket = d.bucket;
    list.append(li);
  }
  box.append(list);
}

// ---- runtime settings: the global default and the unlabeled policy ----

function renderSettings() {
  if (!defaults) return;
  for (const [id, key] of [["set-default", "default_policy"], ["set-unlabeled", "unlabeled"]]) {
    const s = $(id);
    const keep = s.value;
    s.replaceChildren();
    for (const name of Object.keys(policies)) {
      const o = el("option", name);
      o.value = name;
      s.append(o);
    }
    // A choice not yet saved survives the periodic refresh.
    s.value = s.dataset.dirty && keep ? keep : defaults[key];
    s.disabled = !canWrite() || !!settingsReadOnly();
  }
  const why = settingsReadOnly();
  $("set-save").hidden = !!why;
  const src = $("settings-source");
  src.replaceChildren();
  if (why) {
    // Said up front, with the text to paste where the settings come from.
    src.className = "ro-note";
    src.append(el("span", "Read-only here: " + why + " "), exportLink("Export the configuration to paste into its source"));
  } else {
    src.className = "muted";
    src.textContent = "Written to " + defaults.file + " (comments and layout kept).";
  }
}

function settingsReadOnly() {
  return defaults && defaults.editable ? defaults.editable.settings.read_only : null;
}

function exportLink(text) {
  const a = el("a", text);
  a.href = "/v1/export?format=toml";
  a.download = "egress-policies.toml";
  return a;
}

function settingsChosen() {
  for (const id of ["set-default", "set-unlabeled"]) $(id).dataset.dirty = "1";
}

function saveSettings() {
  const body = { default_policy: $("set-default").value, unlabeled: $("set-unlabeled").value };
  propose("Runtime settings", "PUT", "/v1/defaults?dry_run=1", "/v1/defaults", body, null);
}

// ---- policies: list, editor ----

function hostsText(list) {
  return (list || []).map((h) => (typeof h === "string" ? h : h.host + (h.ports && h.ports.length ? " " + h.ports.join(",") : ""))).join("\n");
}

function cidrsText(list) {
  return (list || []).map((c) => (typeof c === "string" ? c : c.cidr + (c.ports && c.ports.length ? " " + c.ports.join(",") : ""))).join("\n");
}

// `HOST` or `HOST PORT,PORT` per line → the policy's entries (`key`: host or cidr).
function entries(text, key) {
  const out = [];
  for (const line of text.split("\n")) {
    const [what, ports] = line.trim().split(/\s+/, 2);
    if (!what) continue;
    if (!ports) {
      out.push(what);
      continue;
    }
    const e = {};
    e[key] = what;
    e.ports = ports.split(",").map((p) => Number(p.trim()));
    out.push(e);
  }
  return out;
}

function usersOf(name) {
  return containers.filter((c) => c.policy === name).map((c) => c.container || c.owner || String(c.cgroup_id));
}

function renderPolicies(all) {
  const body = document.querySelector("#policies tbody");
  body.replaceChildren();
  // Where new policies would be written, when the API can't: said before anyone edits.
  const dirWhy = newPoliciesReadOnly();
  $("policy-new").hidden = !!dirWhy;
  $("policies-note").hidden = !dirWhy;
  $("policies-note").textContent = dirWhy ? "Read-only here: " + dirWhy : "";
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
    const allows = p.mode === "allowlist" || !p.mode ? hosts.concat(cidrs).join(", ") || "nothing" : "";
    const actions = el("td");
    const why = readOnly(name);
    tr.dataset.readOnly = why ? "1" : "";
    if (why) actions.append(readOnlyMark(why));
    if (canWrite() && !why) {
      actions.append(
        button("Edit", () => openEditor(name, false)),
        button("Delete", () => propose("Delete policy " + name, "DELETE",
          "/v1/policies/" + encodeURIComponent(name) + "?dry_run=1", "/v1/policies/" + encodeURIComponent(name), undefined, null)),
      );
    }
    if (canWrite() && !newPoliciesReadOnly()) actions.append(button("Duplicate", () => openEditor(name, true)));
    // A policy in the main file: its text to paste there.
    if (why && defaults.editable.policies[name].source === "config") actions.append(exportLink("export"));
    tr.append(el("td", name), td, el("td", roles.join(", ")), el("td", allows), el("td", usersOf(name).join(", ")), actions);
    body.append(tr);
  }
}

// `scope`: for a policy made from a suggestion, the recorded traffic its replay decides again
// (`{run}`, `{container}` or `{pod}`; any policy's).
async function openEditor(name, duplicate, suggested, scope) {
  let base = suggested || {};
  if (name && !suggested) {
    try {
      base = (await get("/v1/policies/" + encodeURIComponent(name))).policy || {};
    } catch (_) {
      base = policies[name] || {};
    }
  }
  editing = { name: duplicate || suggested ? "" : name, base, scope: scope || null };
  $("editor").hidden = false;
  $("editor-title").textContent = suggested ? "New policy from what " + describeScope(scope) + " did"
    : !name ? "New policy" : duplicate ? "Duplicate of " + name : "Policy " + name;
  $("ed-name").value = duplicate ? name + "-copy" : name || "";
  $("ed-name").disabled = !!name && !duplicate && !suggested;
  $("ed-mode").value = base.mode || "allowlist";
  $("ed-enforce").value = base.enforce || "enforce";
  $("ed-hosts").value = hostsText(base.allow_hosts);
  $("ed-cidrs").value = cidrsText(base.allow_cidrs);
  $("ed-ports").value = (base.allow_ports || [80, 443]).join(", ");
  const other = Object.assign({}, base);
  for (const k of ["mode", "enforce", "allow_hosts", "allow_cidrs", "allow_ports"]) delete other[k];
  $("ed-other").textContent = Object.keys(other).length ? JSON.stringify(other, null, 2) : "(none)";
  clearFieldErrors();
  $("editor").scrollIntoView({ block: "start" });
}

// A policy's fields without those at their default (empty lists, published ports allowed, mode
// allowlist), so a file written from the page says what the policy does and its diff shows
// what changed.
function trimmed(p) {
  const out = {};
  for (const [k, v] of Object.entries(p)) {
    if (Array.isArray(v) && v.length === 0 && k !== "allow_hosts") continue;
    if (k === "allow_published_ports" && v === true) continue;
    if (k === "mode" && v === "allowlist") continue;
    out[k] = v;
  }
  return out;
}

function editorBody() {
  const body = Object.assign({}, editing ? editing.base : {});
  body.mode = $("ed-mode").value;
  if ($("ed-enforce").value === "audit") body.enforce = "audit";
  else delete body.enforce;
  body.allow_hosts = entries($("ed-hosts").value, "host");
  body.allow_cidrs = entries($("ed-cidrs").value, "cidr");
  body.allow_ports = $("ed-ports").value.split(",").map((p) => p.trim()).filter((p) => p).map(Number);
  return trimmed(body);
}

function previewEditor() {
  const name = $("ed-name").value.trim();
  const body = editorBody();
  const path = "/v1/policies/" + encodeURIComponent(name);
  // A policy made from a run's suggestion is replayed against that run's traffic.
  const replay = Object.assign({ name, policy: body }, editing && editing.scope ? editing.scope : {});
  if (editing && editing.scope) replay.against = "any";
  propose("Policy " + name, "PUT", path + "?dry_run=1", path, body, replay);
  if (editing && editing.scope) {
    pending.after = "A new policy applies to nothing until a workload names it: start the next run with the label egress.policy=" + name + ".";
  }
}

function describeScope(scope) {
  if (!scope) return "this workload";
  if (scope.run) return "run " + scope.run;
  if (scope.pod) return "pod " + scope.pod;
  if (scope.container) return "container " + scope.container;
  return "policy " + scope.policy;
}

// ---- denials: each one can become a rule ----

function denialText(ev) {
  const ctx = ev.context || {};
  return [ev.container ? ev.container.name : "", ev.policy, ev.host, ev.ip, ev.port, ev.reason, ev.rule,
    Object.entries(ctx).map(([k, v]) => k + "=" + v).join(" ")].join(" ").toLowerCase();
}

// Allow these denials' destinations (all refused under one policy) in that policy, in one
// change: each host (with its port when the policy does not allow that port everywhere), or
// address as a /32 or /128.
async function allowDenials(evs) {
  const names = [...new Set(evs.map((ev) => ev.policy))];
  if (names.length !== 1) {
    refuseInPanel("Allow " + evs.length + " denials", "the selected denials were refused under " + names.join(", ") +
      ": select denials of one policy (each policy is one change)");
    return;
  }
  const name = names[0];
  let base = {};
  try {
    base = (await get("/v1/policies/" + encodeURIComponent(name))).policy || {};
  } catch (e) {
    refuseInPanel("Allow for " + name, "policy " + name + " could not be read: " + e.message);
    return;
  }
  const body = trimmed(base);
  // Allowing something in a deny_all policy makes it an allowlist of that.
  if (body.mode === "deny_all") delete body.mode;
  const ports = base.allow_ports || [80, 443];
  body.allow_hosts = (base.allow_hosts || []).slice();
  body.allow_cidrs = (base.allow_cidrs || []).slice();
  const whats = [];
  const seen = new Set();
  for (const ev of evs) {
    const port = Number(ev.port);
    const key = (ev.host || ev.ip) + ":" + port;
    if (seen.has(key)) continue;
    seen.add(key);
    if (ev.host) {
      body.allow_hosts.push(ports.includes(port) ? ev.host : { host: ev.host, ports: [port] });
      whats.push(ev.host + ":" + port);
    } else {
      const cidr = ev.ip.includes(":") ? ev.ip + "/128" : ev.ip + "/32";
      body.allow_cidrs.push({ cidr, ports: [port] });
      whats.push(cidr + " port " + port);
    }
  }
  const path = "/v1/policies/" + encodeURIComponent(name);
  propose("Allow " + whats.join(", ") + " for policy " + name, "PUT", path + "?dry_run=1", path, trimmed(body), { name, policy: trimmed(body) });
}

function refuseInPanel(title, text) {
  $("change").hidden = false;
  $("change-title").textContent = title;
  $("change-note").textContent = "";
  $("change-diff").textContent = "";
  $("change-error").hidden = false;
  $("change-error").textContent = text;
  $("change-apply").disabled = true;
  $("change-replay-run").hidden = true;
  $("change").scrollIntoView({ block: "start" });
}

// What a denial's workload is, as a store selection: its run, else its pod, else its container.
function scopeOf(ev) {
  const ctx = ev.context || {};
  if (ctx.run) return { run: ctx.run };
  if (ctx["k8s.pod.name"]) return { pod: (ctx["k8s.namespace.name"] ? ctx["k8s.namespace.name"] + "/" : "") + ctx["k8s.pod.name"] };
  if (ev.container && ev.container.name) return { container: ev.container.name };
  return null;
}

// A new policy made from the suggestion for this denial's run (or pod, or container): what it
// did, allowed and refused, as an allowlist, opened in the editor to review, replay and save.
async function suggestFor(ev) {
  const scope = scopeOf(ev);
  if (!scope) return;
  const label = Object.values(scope)[0];
  const name = ("from-" + label).toLowerCase().replace(/[^a-z0-9_-]+/g, "-").replace(/^-+|-+$/g, "").slice(0, 60);
  const q = new URLSearchParams(scope);
  q.set("include_denied", "1");
  q.set("name", name);
  let r;
  try {
    r = await get("/v1/suggest?" + q.toString());
  } catch (e) {
    refuseInPanel("New policy from " + describeScope(scope), "the suggestion could not be made: " + e.message);
    return;
  }
  if (!r.policy) {
    refuseInPanel("New policy from " + describeScope(scope), "nothing was recorded for " + describeScope(scope));
    return;
  }
  await openEditor(name, false, r.policy, scope);
}

function selectedDenials() {
  return recent.filter(({ ev }) => ev._selected).map(({ ev }) => ev);
}

function renderSelection() {
  const n = selectedDenials().length;
  $("denials-allow-selected").hidden = !canWrite() || n === 0;
  $("denials-allow-selected").textContent = "Allow " + n + " selected";
}

function denialRow(ev, fresh) {
  const tr = el("tr", null, fresh ? "fresh" : "");
  tr.dataset.reason = ev.reason || "";
  const dest = (ev.host || ev.ip || "?") + ":" + ev.port;
  tr.dataset.destination = dest;
  tr.dataset.text = denialText(ev);
  const ctx = ev.context || {};
  // A pod's events name it `namespace/pod`, and the container when the kernel knew it.
  let name = ev.container ? ev.container.name : ctx.exec || "-";
  if (ctx["k8s.container.name"]) name += " (" + ctx["k8s.container.name"] + ")";
  const t = (ev.time || "").replace("T", " ").replace(/\.\d+Z$/, "Z");
  const action = el("td");
  const pick = el("td");
  // Only a policy the agent has by name can take a rule (not an inline label policy), and
  // only one the API may write.
  const why = ev.policy && policies[ev.policy] ? readOnly(ev.policy) : "no policy of that name to add to";
  if (canWrite() && ev.policy && ev.verdict !== "allow") {
    if (why) {
      action.append(readOnlyMark(why));
    } else {
      action.append(button("Allow", () => allowDenials([ev]), "allow"));
      const box = el("input");
      box.type = "checkbox";
      box.className = "pick";
      box.checked = !!ev._selected;
      box.title = "select for one change allowing several";
      box.addEventListener("change", () => { ev._selected = box.checked; renderSelection(); });
      pick.append(box);
    }
    if (scopeOf(ev) && !newPoliciesReadOnly()) {
      action.append(button("New policy…", () => suggestFor(ev), "suggest"));
    }
  }
  tr.append(pick, el("td", t), el("td", name), el("td", ev.policy), el("td", dest), el("td", ev.verdict || "deny"), el("td", ev.reason), el("td", ev.rule || "-"), action);
  return tr;
}

let recent = [];

function addDenial(ev, fresh) {
  recent.unshift({ ev, fresh });
  recent = recent.slice(0, MAX_DENIALS);
  const body = document.querySelector("#denials tbody");
  const tr = denialRow(ev, fresh);
  tr.hidden = !matchesFilter(tr);
  body.prepend(tr);
  while (body.children.length > MAX_DENIALS) body.lastElementChild.remove();
  $("denials-empty").hidden = true;
}

function renderDenials() {
  const body = document.querySelector("#denials tbody");
  body.replaceChildren();
  for (const { ev, fresh } of recent) {
    const tr = denialRow(ev, fresh);
    tr.hidden = !matchesFilter(tr);
    body.append(tr);
  }
  renderSelection();
}

// The header's filter, over every list (workloads, denials, changes): each word must appear in
// the row's text, context labels included (`run=pr-1842`, `k8s.namespace.name=ci`, …).
function matchesFilter(tr) {
  const f = $("filter").value.trim().toLowerCase();
  return !f || f.split(/\s+/).every((w) => (tr.dataset.text || "").includes(w));
}

function applyFilter() {
  for (const tr of document.querySelectorAll("#containers tbody tr, #denials tbody tr, #changes tbody tr, #requests tbody tr")) {
    tr.hidden = !matchesFilter(tr);
  }
}

// ---- access requests: what workloads asked for, decided here ----

function renderRequests(list) {
  const body = document.querySelector("#requests tbody");
  body.replaceChildren();
  const rows = Array.isArray(list) ? list.slice().reverse() : [];
  for (const q of rows) {
    const tr = el("tr", null, q.state === "pending" ? "fresh" : "");
    tr.dataset.request = String(q.id);
    tr.dataset.state = q.state;
    const wants = q.host + ":" + q.port;
    const who = q.workload + (q.run ? " (run " + q.run + ")" : "");
    let state = q.state;
    if (q.scope) state += " (" + q.scope + ")";
    if (q.reason && q.state === "denied") state += ": " + q.reason;
    const reason = q.state === "denied" ? "" : q.reason;
    const actions = el("td");
    if (canWrite() && q.state === "pending") {
      const path = "/v1/requests/" + q.id + "/approve";
      actions.append(
        button("Allow for this run", () => propose("Allow " + wants + " for " + who + " alone", "POST", path + "?dry_run=1", path, { scope: "run" }, null), "allow-run"),
      );
      if (!readOnly(q.policy)) {
        actions.append(button("Allow in policy " + q.policy, () => propose("Allow " + wants + " in policy " + q.policy, "POST", path + "?dry_run=1", path, { scope: "policy" }, null), "allow-policy"));
      }
      const why = el("input");
      why.className = "deny-reason";
      why.placeholder = "reason (the workload reads it)";
      actions.append(why, button("Deny", () => denyRequest(q.id, why.value), "deny"));
    }
    tr.append(el("td", q.id), el("td", (q.time || "").replace("T", " ").replace(/\.\d+Z$/, "Z")), el("td", who), el("td", q.policy), el("td", wants), el("td", reason), el("td", state), actions);
    tr.dataset.text = [who, q.policy, wants, q.reason, q.state].join(" ").toLowerCase();
    tr.hidden = !matchesFilter(tr);
    body.append(tr);
  }
  $("requests-empty").hidden = rows.length > 0;
}

async function denyRequest(id, reason) {
  const r = await send("POST", "/v1/requests/" + id + "/deny", { reason: reason.trim() });
  if (!r.ok) {
    refuseInPanel("Deny request " + id, r.body.error || "refused (" + r.status + ")");
    return;
  }
  await refresh();
}

// ---- the rest: summary, containers, changes, doctor ----

function renderSummary(s) {
  const box = $("summary");
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
  // Docker containers, Kubernetes pods (`namespace/name`) and exec commands (`exec:PID`).
  const rows = (Array.isArray(list) ? list : []).filter((c) => c.container);
  for (const c of rows) {
    const name = c.container;
    const tr = el("tr");
    tr.dataset.container = name;
    tr.dataset.kind = c.kind || "";
    const badgeName = c.badge || badgeOf(policies[c.policy]);
    const kind = c.kind === "pod" || c.kind === "exec" ? c.kind : "container";
    const policy = el("td", c.policy || "-");
    // Where its policy came from: label, annotation, default, namespace default, unlabeled…
    if (c.source) policy.append(el("span", " (" + c.source + ")", "muted"));
    tr.append(el("td", name), el("td", kind), policy);
    tr.dataset.text = [name, kind, c.policy, c.source, Object.entries(c.context || {}).map(([k, v]) => k + "=" + v).join(" ")].join(" ").toLowerCase();
    tr.hidden = !matchesFilter(tr);
    const td = el("td");
    td.append(badge(badgeName));
    tr.append(td, el("td", c.allowed, "num"), el("td", c.denied, "num"), el("td", c.proxied, "num"));
    body.append(tr);
  }
  $("containers-empty").hidden = rows.length > 0;
}

function renderChanges(list) {
  const body = document.querySelector("#changes tbody");
  body.replaceChildren();
  for (const c of (Array.isArray(list) ? list : []).slice().reverse()) {
    const tr = el("tr");
    tr.dataset.change = String(c.id);
    const whoText = c.identity || "uid " + c.uid;
    const diff = el("td");
    if (c.diff) {
      const d = el("details");
      d.append(el("summary", "diff"), el("pre", c.diff, "diff"));
      diff.append(d);
    }
    tr.append(el("td", (c.time || "").replace("T", " ").replace(/\.\d+Z$/, "Z")), el("td", whoText), el("td", c.action), el("td", c.target), el("td", c.result), diff);
    tr.dataset.text = [whoText, c.action, c.target, c.result].join(" ").toLowerCase();
    tr.hidden = !matchesFilter(tr);
    body.append(tr);
  }
}

let proxyCheck = null;

// Whether the proxy is up: the doctor's `proxy.listening` probe.
function renderProxyState() {
  const p = $("proxy-state");
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
    const [status, pols, defs] = await Promise.all([get("/v1/status"), get("/v1/policies"), get("/v1/defaults").catch(() => null)]);
    policies = pols;
    defaults = defs;
    containers = await get("/v1/containers");
    renderSummary(status);
    renderPolicies(pols);
    renderContainers(containers);
    renderSettings();
    renderDenials();
    get("/v1/changes?n=20").then(renderChanges).catch(() => {});
    get("/v1/requests").then(renderRequests).catch(() => { $("requests-section").hidden = true; });
  } catch (e) {
    $("summary").textContent = who || !e.message.endsWith("401")
      ? "the daemon did not answer: " + e.message
      : "sign in to see this host";
  }
}

async function importFile() {
  const f = $("import-file").files[0];
  if (!f) return;
  const text = await f.text();
  const prune = $("import-prune").checked;
  const type = f.name.endsWith(".json") ? "application/json" : "application/toml";
  $("import-file").value = "";
  // The import's dry run is the plain POST; `apply=1` writes.
  propose("Import " + f.name, "POST", "/v1/import" + (prune ? "?prune=1" : ""),
    "/v1/import?apply=1" + (prune ? "&prune=1" : ""), text, null, type);
}

function live() {
  const badgeEl = $("live");
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
  $("change-apply").addEventListener("click", applyPending);
  $("change-replay-run").addEventListener("click", replayPending);
  $("change-cancel").addEventListener("click", () => { pending = null; $("change").hidden = true; });
  $("set-save").addEventListener("click", saveSettings);
  $("set-default").addEventListener("change", settingsChosen);
  $("set-unlabeled").addEventListener("change", settingsChosen);
  $("policy-new").addEventListener("click", () => openEditor(null, false));
  $("denials-allow-selected").addEventListener("click", () => allowDenials(selectedDenials()));
  $("ed-preview").addEventListener("click", previewEditor);
  $("ed-close").addEventListener("click", () => { $("editor").hidden = true; });
  $("filter").addEventListener("input", applyFilter);
  $("import-file").addEventListener("change", importFile);
  await loadSession();
  await refresh();
  try {
    for (const ev of await get("/v1/events?n=" + MAX_DENIALS)) addDenial(ev, false);
  } catch (_) { /* shown by refresh */ }
  live();
  get("/v1/doctor").then(renderDoctor).catch(() => {});
  setInterval(refresh, 5000);
}

document.addEventListener("DOMContentLoaded", start);
