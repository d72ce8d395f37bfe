import { apiText, get, type Call, type Frame } from "../api";
import { flameGraph } from "../hier";
import type { Ctx } from "../main";
import { fmtInt, fmtMs } from "../format";
import { h, fmtBytes, fmtTime, site, link, section } from "../util";

const KIND_COLOR: Record<string, string> = { db: "#1f77b4", http: "#ff7f0e", cache: "#2ca02c" };

function label(c: Call): string {
  if (c.kind === "http") return `${c.op ?? ""} ${c.host ?? ""} ${c.fingerprint ?? ""}`.trim();
  return c.fingerprint ?? c.op ?? c.kind;
}

function stackList(stack: Frame[]): HTMLElement {
  return h(
    "ol",
    { class: "stack" },
    stack.map((f) => h("li", { class: f.app ? "app" : "lib" }, `${site(f)}`, h("span", { class: "dim" }, ` ${f.file ?? ""}`))),
  );
}

export async function tracePage(root: HTMLElement, ctx: Ctx): Promise<void> {
  const id = ctx.params.get("id") || "";
  if (!id) throw new Error("no trace id given");
  const t = await get("/api/traces/{trace_id}", { trace_id: id });
  const total = Math.max(t.duration_ms ?? 0, ...t.calls.map((c) => (c.offset_ms ?? 0) + (c.duration_ms ?? 0)), 0.001);
  root.append(
    h("h1", {}, link(ctx.href("endpoint", { name: t.endpoint }), t.endpoint, { class: "endpoint-link" }), h("span", { class: "dim" }, ` · trace ${t.trace_id}`)),
    h(
      "div",
      { class: "cards" },
      ...(
        [
          ["duration ms", fmtMs(t.duration_ms)],
          ["status", String(t.status ?? "-")],
          ["calls", fmtInt(t.calls.length)],
          ["CPU ms", fmtMs(t.cpu_ms)],
          ["user", t.user ?? "-"],
          ["tenant", t.tenant ?? "-"],
          ["time (UTC)", fmtTime(t.ts)],
        ] as [string, string][]
      ).map(([l, v]) => h("div", { class: "stat", "data-stat": l }, h("div", { class: "stat-value" }, v), h("div", { class: "stat-label" }, l))),
    ),
  );
  const kv: [string, unknown][] = [
    ["path", t.path],
    ["service", t.service],
    ["host / pid", `${t["host"] ?? "?"} / ${t["pid"] ?? "?"}`],
    ["request bytes", fmtBytes(t["req_bytes"] as number | null)],
    ["response bytes", fmtBytes(t["resp_bytes"] as number | null)],
    ["error", t["error"] ?? "-"],
    ...Object.entries(t.attributes).map(([k, v]) => [`attr ${k}`, v] as [string, unknown]),
    ...Object.entries(t.tags).map(([k, v]) => [`tag ${k}`, v] as [string, unknown]),
  ];
  root.append(section("Attributes and tags", h("table", { class: "grid kv", id: "attributes" }, h("tbody", {}, kv.map(([k, v]) => h("tr", {}, h("th", {}, k), h("td", { class: "mono" }, String(v))))))));

  if (t.replay) {
    const r = t.replay;
    const status = h("span", { class: "dim", id: "copy-status" });
    const copy = async () => {
      try {
        const text = r.complete ? r.curl : (await apiText(`traces/${encodeURIComponent(t.trace_id)}/curl`)).trimEnd();
        await copyText(text);
        status.textContent = `copied (${text.length.toLocaleString("en-US")} characters)`;
      } catch (e) {
        status.textContent = `copy failed: ${e instanceof Error ? e.message : String(e)}`;
      }
    };
    root.append(
      section(
        "Replay this request",
        h(
          "div",
          { class: "row" },
          h("button", { id: "copy-curl", onclick: () => void copy() }, "Copy curl command"),
          status,
          h("span", { class: "dim" }, `captured because: ${r.reason ?? "?"} · body ${fmtBytes(r.body_size)}${r.body_truncated ? " (truncated)" : ""}${r.redacted.length ? ` · redacted headers left out: ${r.redacted.join(", ")}` : ""}`),
        ),
        r.note ? h("div", { class: "error" }, r.note) : null,
        h("pre", { class: "code curl", id: "replay-curl" }, r.curl),
        h("div", { class: "dim" }, "or re-send it and compare timings: ", h("code", {}, `perfsleuth replay ${t.trace_id} --to http://127.0.0.1:8000`)),
      ),
    );
  }

  // Waterfall: one row per call, the bar placed at its offset within the request.
  const rows = t.calls.map((c) => {
    const left = ((c.offset_ms ?? 0) / total) * 100;
    const width = Math.max(0.15, ((c.duration_ms ?? 0) / total) * 100);
    const detail = h("div", { class: "call-detail", hidden: true }, c.stack.length ? stackList(c.stack) : h("span", { class: "dim" }, "no stack recorded for this call (it shares its site's stack)"));
    const row = h(
      "div",
      { class: "wf-row", "data-kind": c.kind, onclick: () => (detail.hidden = !detail.hidden) },
      h("span", { class: "wf-off mono" }, fmtMs(c.offset_ms)),
      h("span", { class: "wf-dur mono" }, fmtMs(c.duration_ms)),
      h("span", { class: "wf-track" }, h("span", { class: "wf-bar", style: { left: left.toFixed(3) + "%", width: width.toFixed(3) + "%", background: KIND_COLOR[c.kind] ?? "#888" } })),
      h("span", { class: "wf-label mono", title: label(c) }, `${c.kind}${c.system ? "/" + c.system : ""} `, label(c), c.rows !== null ? h("span", { class: "dim" }, ` · ${fmtInt(c.rows)} rows`) : null, c.error ? h("span", { class: "err" }, ` · ${c.error}`) : null),
      h("span", { class: "wf-site mono dim" }, site(c.site)),
    );
    return h("div", {}, row, detail);
  });
  root.append(
    section(
      `Waterfall (${fmtInt(t.calls.length)} calls; offsets and durations in ms; click a row for its stack)`,
      h("div", { class: "wf-head" }, h("span", { class: "wf-off" }, "offset"), h("span", { class: "wf-dur" }, "ms"), h("span", { class: "wf-track" }, `0 — ${fmtMs(total)} ms`), h("span", { class: "wf-label" }, "call"), h("span", { class: "wf-site" }, "call site")),
      h("div", { class: "waterfall", id: "waterfall" }, t.calls.length ? rows : h("p", { class: "dim" }, "This request made no recorded calls.")),
    ),
  );

  if (t.stack_samples.length) {
    // Samples along the request, and the innermost application frames they were in.
    const strip = h(
      "div",
      { class: "sample-strip" },
      t.stack_samples.map((s) => {
        const leaf = [...s.stack].reverse().find((f) => f.app) ?? s.stack[s.stack.length - 1];
        return h("span", { class: `sample ${s.state}`, style: { left: ((s.offset_ms / total) * 100).toFixed(2) + "%" }, title: `${fmtMs(s.offset_ms)} ms ${s.state}: ${site(leaf)}` });
      }),
    );
    const counts = new Map<string, { n: number; cpu: number }>();
    for (const s of t.stack_samples) {
      const leaf = [...s.stack].reverse().find((f) => f.app) ?? s.stack[s.stack.length - 1];
      const k = site(leaf);
      const c = counts.get(k) ?? { n: 0, cpu: 0 };
      c.n++;
      if (s.state === "cpu" || s.state === "starved") c.cpu++; // computing, or waiting for a CPU
      counts.set(k, c);
    }
    const flame = h("div", { class: "flame-box" });
    if (t.profile) requestAnimationFrame(() => flame.append(flameGraph(t.profile!, Math.max(400, flame.clientWidth))));
    root.append(
      section(
        `Stack samples (${fmtInt(t.stack_samples.length)}; red = on CPU, orange = waiting for a CPU, purple = waiting for the GIL, blue = in a recorded call, grey = waiting)`,
        strip,
        flame,
        h("table", { class: "grid" }, h("thead", {}, h("tr", {}, h("th", {}, "innermost application frame"), h("th", { class: "num" }, "samples"), h("th", { class: "num" }, "on or waiting for a CPU"))), h("tbody", {}, [...counts.entries()].sort((a, b) => b[1].n - a[1].n).map(([k, c]) => h("tr", {}, h("td", { class: "mono" }, k), h("td", { class: "num" }, fmtInt(c.n)), h("td", { class: "num" }, fmtInt(c.cpu)))))),
      ),
    );
  }
  if (t.blocker_events.length) {
    root.append(
      section(
        "Event-loop blockers during this request",
        h("div", {}, t.blocker_events.map((b) => h("div", { class: "blocker" }, h("b", {}, `${fmtMs(b.duration_ms)} ms`), ` blocked the loop, delaying ${fmtInt(b.delayed)} other requests`, b.last_call ? h("span", { class: "dim" }, ` (after ${b.last_call})`) : null, stackList(b.stack)))),
      ),
    );
  }
}

async function copyText(text: string): Promise<void> {
  if (navigator.clipboard && window.isSecureContext) {
    await navigator.clipboard.writeText(text);
    return;
  }
  // Plain http on another host: the clipboard API is not there; the old way still is.
  const area = h("textarea", { style: { position: "fixed", top: "-1000px" } }, text) as HTMLTextAreaElement;
  document.body.append(area);
  area.select();
  const ok = document.execCommand("copy");
  area.remove();
  if (!ok) throw new Error("the browser refused to copy; select the command and copy it by hand");
}
