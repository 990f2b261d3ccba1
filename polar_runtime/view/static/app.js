/* polar view: the run page, a step's samples, a sample, a call and a trained sequence.
 *
 * Every string shown was written by the policy or the task: the DOM is built with createElement
 * and textContent only (never innerHTML of data), colours are set through the CSSOM. Data come in
 * chunks (data/run.js, data/samples/<i>.js) that call polarData(name, value); a chunk is loaded by
 * adding a <script src> (the page's CSP allows scripts of its own origin only). Served (--serve),
 * the page reloads data/run.js every few seconds and redraws the run page when it changed.
 */
"use strict";

const DATA = {};
const WAITING = {};

function polarData(name, value) {
  DATA[name] = value;
  (WAITING[name] || []).forEach((f) => f(value));
  delete WAITING[name];
}
window.polarData = polarData;

function load(name, src, fresh) {
  return new Promise((resolve, reject) => {
    if (DATA[name] !== undefined && !fresh) return resolve(DATA[name]);
    (WAITING[name] = WAITING[name] || []).push(resolve);
    const s = document.createElement("script");
    s.src = src + (fresh ? "?t=" + Date.now() : "");
    s.onerror = () => reject(new Error("cannot load " + src));
    s.onload = () => s.remove();
    document.head.appendChild(s);
  });
}

/* h("div", {class: "x", onclick: f}, "text", child, ...): an element; strings become text nodes */
function h(tag, attrs, ...kids) {
  const el = document.createElement(tag);
  for (const [k, v] of Object.entries(attrs || {})) {
    if (v === undefined || v === null || v === false) continue;
    if (k === "class") el.className = v;
    else if (k === "text") el.textContent = v;
    else if (k.startsWith("on")) el.addEventListener(k.slice(2), v);
    else if (k === "href") el.setAttribute("href", String(v).startsWith("#") ? v : "#");
    else el.setAttribute(k, String(v));
  }
  for (const kid of kids.flat(Infinity)) {
    if (kid === undefined || kid === null || kid === false) continue;
    el.appendChild(typeof kid === "object" ? kid : document.createTextNode(String(kid)));
  }
  return el;
}

const fmt = (v, d = 3) => (v === null || v === undefined ? "–" : typeof v === "number" ? (Number.isInteger(v) ? String(v) : v.toFixed(d)) : String(v));
const main = () => document.getElementById("main");
const sec = (title, ...kids) => h("section", { class: "card" }, h("h2", { text: title }), ...kids);
const pre = (text, cls) => h("pre", { class: cls || "" , text: text === undefined || text === null ? "" : String(text) });

function table(cols, rows, onrow) {
  const t = h("table", {}, h("thead", {}, h("tr", {}, cols.map((c) => h("th", { text: c[0] })))));
  const tb = h("tbody");
  rows.forEach((r) => {
    const tr = h("tr", onrow ? { class: "click", onclick: () => onrow(r) } : {}, cols.map((c) => {
      const v = c[1](r);
      return h("td", {}, v instanceof Node ? v : fmt(v));
    }));
    tb.appendChild(tr);
  });
  t.appendChild(tb);
  return t;
}

/* ---------------------------------------------------------------------------------------------
 * plots (uPlot, vendored): one card each */
const COLORS = ["#2563eb", "#dc2626", "#16a34a", "#9333ea", "#ea580c", "#0891b2", "#ca8a04", "#db2777", "#4b5563"];

function plot(title, xs, series, opts) {
  opts = opts || {};
  const box = h("div", { class: "plot", "data-plot": title });
  const card = h("section", { class: "card plotcard" }, h("h2", { text: title }), box);
  if (!xs.length) {
    box.appendChild(h("p", { class: "muted", text: "nothing yet" }));
    return card;
  }
  const data = [xs, ...series.map((s) => s.values)];
  const u = {
    width: 400, height: 200,
    scales: { x: { time: false, range: (u, lo, hi) => (lo === hi ? [lo - 1, hi + 1] : [lo, hi]) },
      y: opts.share ? { range: [0, 1] } : {} },
    axes: [{ label: opts.xlabel || "step", incrs: [1, 2, 5, 10, 20, 50, 100, 200, 500, 1000] }, { label: opts.ylabel || "" }],
    series: [{ label: opts.xlabel || "step" }, ...series.map((s, i) => ({
      label: s.label, stroke: COLORS[i % COLORS.length], width: 2,
      fill: opts.bars ? COLORS[i % COLORS.length] + "55" : undefined,
      paths: opts.bars ? uPlot.paths.bars({ size: [0.6, 40] }) : undefined,
      points: { show: true, size: 6 }, spanGaps: true,
    }))],
    legend: { show: true },
  };
  requestAnimationFrame(() => {
    const inst = new uPlot(u, data, box);
    if (opts.onclick) {
      inst.over.addEventListener("click", () => {
        const i = inst.cursor.idx;
        if (i !== null && i !== undefined) opts.onclick(xs[i]);
      });
      inst.over.classList.add("click");
    }
  });
  return card;
}

/* ---------------------------------------------------------------------------------------------
 * the run page */
function runPage(run) {
  const m = main();
  m.replaceChildren();
  setWhere(`${run.root}  ·  ${run.model || "?"}  ·  ${run.harness || "?"}`);
  const rw = run.rewards || [];
  const steps = rw.map((r) => r.step);
  const go = (s) => (location.hash = "#/step/" + s);
  const grid = h("div", { class: "grid" });
  grid.appendChild(plot("reward per step (click a step)", steps,
    [{ label: "mean", values: rw.map((r) => r.mean) },
     ...(run.tasks || []).map((t) => ({ label: t, values: rw.map((r) => r.per_task[t]) }))],
    { ylabel: "reward", onclick: go }));
  grid.appendChild(plot("pass rate (reward > 0)", steps, [{ label: "pass rate", values: rw.map((r) => r.pass_rate) }], { ylabel: "share", onclick: go, share: true }));
  const st = run.staleness || [];
  grid.appendChild(plot("staleness of trained tokens", st.map((s) => s.age), [{ label: "tokens", values: st.map((s) => s.tokens) }],
    { xlabel: "versions behind", bars: true }));
  const idle = run.idle || [];
  grid.appendChild(plot("idle fraction (so far)", idle.map((r) => r.step),
    [{ label: "trainer", values: idle.map((r) => r.trainer) }, { label: "vLLM", values: idle.map((r) => r.vllm) }], { ylabel: "fraction", share: true }));
  const ph = (run.phases || {}).per_step || [];
  grid.appendChild(plot("phase times per step", ph.map((p) => p.step),
    [{ label: "rollout s", values: ph.map((p) => p.rollout_s) }, { label: "train s", values: ph.map((p) => p.train_s) },
     { label: "push s", values: ph.map((p) => p.push_s) }], { ylabel: "seconds" }));
  const dr = (run.drift || {});
  grid.appendChild(plot("drift causes per step", (dr.steps || []).map((s) => s.step),
    (dr.causes || []).map((c) => ({ label: c, values: dr.steps.map((s) => s.counts[c] || 0) })), { ylabel: "calls" }));
  const mg = run.merges || [];
  grid.appendChild(plot("merge rate", mg.map((r) => r.step),
    [{ label: "merged", values: mg.map((r) => r.merge_rate) }, { label: "exact", values: mg.map((r) => r.exact_rate) }], { ylabel: "share", share: true }));
  const tr = run.train || [];
  grid.appendChild(plot("training", tr.map((r) => r.step),
    [{ label: "loss", values: tr.map((r) => r.loss) }, { label: "mismatch_kl", values: tr.map((r) => r.mismatch_kl) },
     { label: "kl", values: tr.map((r) => r.kl) }], { xlabel: "optimizer step" }));
  m.appendChild(grid);
  /* the plots are drawn in animation frames queued above; one queued now runs after them */
  delete document.body.dataset.painted;
  requestAnimationFrame(() => { document.body.dataset.painted = "run"; });
  const timing = run.timing || {};
  if (timing.wall_s !== undefined)
    m.appendChild(sec("loop", h("p", {}, `wall ${fmt(timing.wall_s, 0)} s · trainer idle ${fmt(timing.trainer_idle_frac)} · vLLM idle ${fmt(timing.vllm_idle_frac)} · both busy ${fmt(timing.overlap_s, 0)} s`)));
  m.appendChild(sec("steps", table([["step", (r) => h("a", { href: "#/step/" + r.step, class: "step-link", text: "step " + r.step })],
    ["samples", (r) => r.samples], ["mean reward", (r) => r.mean], ["pass rate", (r) => r.pass_rate],
    ["status", (r) => Object.entries(r.status).map(([k, v]) => k + " " + v).join(", ")]], rw, (r) => go(r.step))));
  if (((run.phases || {}).demo || []).length)
    m.appendChild(sec("demo phases", table([["phase", (p) => p.name], ["seconds", (p) => p.seconds], ["detail", (p) => p.detail]], run.phases.demo)));
}

function stepPage(run, step) {
  const m = main();
  m.replaceChildren();
  setWhere(`step ${step}`);
  const rows = (run.samples || []).filter((s) => String(s.step) === String(step));
  m.appendChild(sec(`samples of step ${step}`, table([
    ["sample", (s) => h("a", { href: "#/sample/" + s.i, class: "sample-link", text: s.session_id })],
    ["task", (s) => s.task_id], ["status", (s) => s.status], ["reward", (s) => s.reward], ["calls", (s) => s.calls],
    ["sampled tokens", (s) => s.sampled_tokens], ["wall s", (s) => s.wall_s], ["trained", (s) => (s.trained ? "yes" : "no")]],
  rows, (s) => (location.hash = "#/sample/" + s.i))));
}

/* ---------------------------------------------------------------------------------------------
 * a sample */
function content(c) {
  if (c === null || c === undefined) return "";
  if (typeof c === "string") return c;
  if (Array.isArray(c)) return c.map((p) => (typeof p === "string" ? p : p.text !== undefined ? p.text : JSON.stringify(p))).join("\n");
  return JSON.stringify(c, null, 1);
}

function message(msg) {
  const role = String(msg.role || "?");
  const box = h("div", { class: "msg role-" + role.replace(/[^a-z]/g, "") }, h("div", { class: "role", text: role + (msg.final ? " (last answer)" : "") }));
  if (msg.reasoning || msg.reasoning_content) box.appendChild(pre(msg.reasoning || msg.reasoning_content, "reasoning"));
  const text = content(msg.content);
  if (text) box.appendChild(pre(text, "text"));
  (msg.tool_calls || []).forEach((tc) => {
    const f = tc.function || tc;
    box.appendChild(h("div", { class: "toolcall" }, h("b", { text: "tool call " }), f.name || "?", pre(typeof f.arguments === "string" ? f.arguments : JSON.stringify(f.arguments))));
  });
  if (msg.tool_call_id) box.appendChild(h("div", { class: "muted", text: "result of " + msg.tool_call_id }));
  return box;
}

function kv(obj, keys) {
  return h("dl", { class: "kv" }, keys.filter((k) => obj[k] !== undefined && obj[k] !== null && obj[k] !== "").map((k) => [h("dt", { text: k }), h("dd", {}, pre(typeof obj[k] === "object" ? JSON.stringify(obj[k]) : fmt(obj[k])))]));
}

async function samplePage(i, sub) {
  const m = main();
  let s;
  try {
    s = await load("sample/" + i, "data/samples/" + i + ".js", isLive());
  } catch (e) {
    m.replaceChildren(h("p", { class: "error", text: String(e) }));
    return;
  }
  m.replaceChildren();
  const r = Object.assign({}, s.rollout || {});
  if (typeof r.started_at === "number") r.started_at = new Date(r.started_at * 1000).toISOString();
  setWhere(`${s.session_id} · step ${fmt(r.step)}`);
  m.appendChild(h("p", {}, h("a", { href: "#/step/" + r.step, text: "← step " + r.step })));
  m.appendChild(sec("verdict", kv(r, ["task_id", "status", "reward", "evaluator_status", "error", "exit_code", "turns"]),
    h("h3", { text: "verifier output" }), pre(r.evaluator_output || "(none)", "verifier"),
    h("h3", { text: "sandbox" }), kv(r, ["sandbox"]), pre(r.sandbox_notes || "(no notes)", "notes"),
    h("h3", { text: "timings" }), kv(r, ["wall_s", "eval_s", "started_at", "calls", "prompt_tokens", "sampled_tokens", "error_calls"])));
  const seqs = s.sequences || [];
  m.appendChild(sec("trained sequences", seqs.length ? table([
    ["sequence", (q) => h("a", { href: `#/sample/${i}/seq/${seqs.indexOf(q)}`, class: "seq-link", text: q.trajectory_id })],
    ["calls", (q) => q.n_calls], ["tokens", (q) => q.ids.length], ["sampled", (q) => q.mask.filter((x) => x).length],
    ["advantage", (q) => q.advantage], ["split", (q) => (q.split ? q.split.label + ": " + q.split.cause : "–")],
    ["trained", (q) => (q.advantage !== null && q.advantage !== undefined ? "steps " + q.trained_steps.join(",") : q.not_trained)]],
  seqs, (q) => (location.hash = `#/sample/${i}/seq/${seqs.indexOf(q)}`)) : h("p", { class: "muted", text: "no sequence was built from this sample" })));
  const calls = s.calls || [];
  m.appendChild(sec("calls", table([
    ["call", (c) => h("a", { href: `#/sample/${i}/call/${calls.indexOf(c)}`, class: "call-link", text: "call " + c.call_index })],
    ["status", (c) => c.status], ["finish", (c) => c.finish_reason], ["policy", (c) => c.policy_version], ["history", (c) => c.history],
    ["prompt ids", (c) => c.n_prompt], ["sampled", (c) => c.sampled.length], ["latency s", (c) => c.timings.t_response_out],
    ["not trained", (c) => c.skip || ""]], calls, (c) => (location.hash = `#/sample/${i}/call/${calls.indexOf(c)}`))));
  const detail = h("div", { id: "detail" });
  m.appendChild(detail);
  m.appendChild(sec("conversation as the harness sent it (last call) and the last answer", ...(s.conversation || []).map(message),
    h("details", {}, h("summary", { text: "the harness's own request body (wire format)" }), pre(JSON.stringify(s.native_request, null, 1)))));
  if ((s.logs || []).length)
    m.appendChild(sec("harness logs (their end)", ...s.logs.map((l) => h("details", {}, h("summary", { text: `${l.name} (${fmt(l.size)} bytes)` }), pre(l.error || l.text, "log")))));
  if (sub && sub[0] === "seq") detail.appendChild(sequenceView(s, seqs[+sub[1]]));
  if (sub && sub[0] === "call") detail.appendChild(callView(s, calls[+sub[1]]));
  if (sub) detail.scrollIntoView();
}

/* ---------------------------------------------------------------------------------------------
 * tokens */
function tokText(s, id) {
  const t = (s.vocab || {})[String(id)];
  return t === undefined ? "#" + id + " " : t;
}

/* probability p in [0, 1] -> background: red (unlikely) .. green (likely) */
function probColor(lp) {
  const p = Math.exp(lp);
  return `hsl(${Math.round(120 * p)}, 75%, ${Math.round(82 - 10 * p)}%)`;
}

const tip = () => document.getElementById("tip");
function showTip(ev, lines) {
  const t = tip();
  t.replaceChildren(...lines.map((l) => h("div", { text: l })));
  t.hidden = false;
  t.style.left = Math.min(ev.clientX + 12, window.innerWidth - 360) + "px";
  t.style.top = ev.clientY + 14 + "px";
}
function hideTip() { tip().hidden = true; }

function token(s, id, info, lp) {
  const el = h("span", { class: "tok " + (info.mask ? "m1" : "m0"), "data-pos": info.pos });
  el.textContent = tokText(s, id);
  if (info.mask && lp !== null && lp !== undefined) el.style.backgroundColor = probColor(lp);
  el.addEventListener("mouseenter", (ev) => showTip(ev, info.lines()));
  el.addEventListener("mouseleave", hideTip);
  return el;
}

function sequenceView(s, q) {
  if (!q) return h("p", { class: "error", text: "no such sequence" });
  const box = h("section", { class: "card seqview" }, h("h2", { text: "sequence " + q.trajectory_id }));
  if (q.split) {
    box.appendChild(h("div", { class: "split" }, h("b", { text: q.split.label }), " — cause: ",
      h("span", { class: "split-cause", text: q.split.cause }), q.split.origin ? ` (${q.split.origin})` : "",
      q.split.detail ? h("div", { class: "muted", text: q.split.detail }) : null,
      q.split.prev_text || q.split.next_text ? h("div", { class: "diff" }, pre("previous: " + (q.split.prev_text || "")), pre("this one: " + (q.split.next_text || ""))) : null));
  }
  const trained = q.advantage !== null && q.advantage !== undefined;
  box.appendChild(kv({ advantage: q.advantage, "trained in step": q.trained_steps.join(", "), "not trained": q.not_trained,
    reward: q.reward, policy_version: q.policy_version, merges: q.merge_kinds.join(", "), temperature: q.temperature,
    sampling_issue: q.sampling_issue }, ["advantage", "trained in step", "not trained", "reward", "policy_version", "merges", "temperature", "sampling_issue"]));
  box.appendChild(h("p", { class: "legend" }, h("span", { class: "tok m1 lg-hi", text: "sampled, likely" }), " ",
    h("span", { class: "tok m1 lg-lo", text: "sampled, unlikely" }), " ", h("span", { class: "tok m0", text: "mask 0: not trained" }),
    " — hover a token for vLLM's and the trainer's logprob"));
  const body = h("div", { class: "tokens" });
  (q.spans || []).forEach((sp) => {
    const kind = sp.kind === "sampled" ? "sampled" : sp.injected ? "injected" : "prompt";
    const why = kind === "sampled" ? "sampled by the model (loss mask 1)" : kind === "injected"
      ? "put between calls by the harness or the template (tool results, glue): mask 0" : "the call's prompt: mask 0";
    const span = h("div", { class: "span span-" + kind, "data-kind": kind },
      h("div", { class: "spanlabel", text: `call ${sp.call_index} · ${kind} · ${sp.end - sp.start} tokens` }));
    const line = h("div", { class: "toks" });
    const add = (a, b, into) => {
      for (let p = a; p < b; p++) {
        const id = q.ids[p], m = q.mask[p], blp = q.behaviour[p], tlp = q.trainer[p];
        into.appendChild(token(s, id, { mask: m, pos: p, lines: () => [
          `token ${id} ${JSON.stringify(tokText(s, id))} at ${p}`,
          `call ${sp.call_index} · ${kind}: ${why}`,
          `mask ${m}` + (m ? "" : " (not trained)"),
          ...(m ? [`vLLM logprob ${fmt(blp, 4)} (p ${fmt(blp === null ? null : Math.exp(blp), 3)})`,
            `trainer logprob ${tlp === null || tlp === undefined ? "– (" + (q.not_trained || "not recorded") + ")" : fmt(tlp, 4)}`,
            ...(tlp !== null && tlp !== undefined && blp !== null ? [`vLLM − trainer ${fmt(blp - tlp, 5)}`] : []),
            `advantage ${fmt(q.advantage, 4)}`] : [])] }, blp));
      }
    };
    const n = sp.end - sp.start;
    if (kind !== "sampled" && n > 400) {  /* a long prompt: its two ends, the middle on demand */
      add(sp.start, sp.start + 120, line);
      const mid = h("span");
      const more = h("button", { class: "more", text: `… ${n - 240} more tokens …` });
      more.addEventListener("click", () => { more.remove(); add(sp.start + 120, sp.end - 120, mid); });
      mid.appendChild(more);
      line.appendChild(mid);
      add(sp.end - 120, sp.end, line);
    } else add(sp.start, sp.end, line);
    span.appendChild(line);
    body.appendChild(span);
  });
  box.appendChild(body);
  if (!trained) box.appendChild(h("p", { class: "muted", text: "why no trainer logprob: " + q.not_trained }));
  return box;
}

function callView(s, c) {
  if (!c) return h("p", { class: "error", text: "no such call" });
  const box = h("section", { class: "card callview" }, h("h2", { text: `call ${c.call_index} (${c.call_id})` }));
  box.appendChild(kv(c, ["status", "http_status", "error", "finish_reason", "policy_version", "provider", "harness", "history", "history_cause", "skip"]));
  box.appendChild(kv(c.timings || {}, ["t_upstream_sent", "t_upstream_first_byte", "t_upstream_end", "t_response_out"]));
  if ((c.translation_notes || []).length) box.appendChild(pre(c.translation_notes.join("\n"), "notes"));
  box.appendChild(h("h3", { text: "sampled tokens (colour: probability vLLM gave each)" }));
  const line = h("div", { class: "toks tokens" });
  c.sampled.forEach((id, p) => {
    const lp = c.logprobs[p];
    line.appendChild(token(s, id, { mask: 1, pos: p, lines: () => [`token ${id} ${JSON.stringify(tokText(s, id))}`, `vLLM logprob ${fmt(lp, 4)} (p ${fmt(lp === null ? null : Math.exp(lp), 3)})`] }, lp));
  });
  box.appendChild(line);
  if (c.output_reasoning) box.appendChild(h("div", {}, h("h3", { text: "reasoning" }), pre(c.output_reasoning)));
  box.appendChild(h("div", { class: "answer" }, h("h3", { text: "answer" }), pre(c.output_text || "(empty)", "text")));
  (c.output_tool_calls || []).forEach((tc) => box.appendChild(h("div", { class: "toolcall" }, h("b", { text: "tool call " }), tc.name || "?", pre(tc.arguments))));
  box.appendChild(h("h3", { text: "raw request and response (saved flow)" }));
  if (!c.raw) box.appendChild(h("p", { class: "muted", text: "no saved flow of this call (captures/flows.mitm)" }));
  else {
    const rq = c.raw.request, rs = c.raw.response;
    box.appendChild(h("details", { class: "raw", open: "" }, h("summary", { text: `${rq.method} ${rq.url} (${rq.body.size} bytes${rq.body.cut ? ", cut" : ""})` }),
      pre(rq.headers.map((x) => x[0] + ": " + x[1]).join("\n"), "headers"), pre(rq.body.text, "body")));
    if (rs) box.appendChild(h("details", { class: "raw" }, h("summary", { text: `response ${rs.status} (${rs.body.size} bytes${rs.body.cut ? ", cut" : ""})` }),
      pre(rs.headers.map((x) => x[0] + ": " + x[1]).join("\n"), "headers"), pre(rs.body.text, "body")));
    if (c.raw.error) box.appendChild(pre("flow error: " + c.raw.error, "error"));
  }
  return box;
}

/* ---------------------------------------------------------------------------------------------
 * routing and live updates */
function setWhere(text) { document.getElementById("where").textContent = text; }
const isLive = () => location.protocol === "http:" || location.protocol === "https:";

function route() {
  hideTip();
  const run = DATA.run;
  if (!run) return;
  const parts = location.hash.replace(/^#\/?/, "").split("/").filter((x) => x);
  if (parts[0] === "step" && parts.length > 1) stepPage(run, decodeURIComponent(parts[1]));
  else if (parts[0] === "sample" && parts.length > 1) samplePage(+parts[1], parts.length > 3 ? parts.slice(2) : null);
  else runPage(run);
  window.scrollTo(0, 0);
}

function poll() {
  const before = JSON.stringify(DATA.run && DATA.run.version);
  load("run", "data/run.js", true).then((run) => {
    document.getElementById("live").textContent = " · live, updated " + new Date().toLocaleTimeString();
    const parts = location.hash.replace(/^#\/?/, "").split("/").filter((x) => x);
    if (JSON.stringify(run.version) !== before && parts[0] !== "sample") route();
  }).catch(() => { document.getElementById("live").textContent = " · live: server not answering"; });
}

window.addEventListener("hashchange", route);
window.addEventListener("DOMContentLoaded", () => {
  if (!DATA.run) {
    main().replaceChildren(h("p", { class: "error", text: "data/run.js did not load" }));
    return;
  }
  route();
  if (isLive()) setInterval(poll, 3000);
});
