// Load: a saved `perfsleuth load` run: the targets, the achieved rate, the verdict line and the
// per-endpoint table (counts, p50/p95 of each side, change, q-value, verdict).
import { api, get } from "../api";
import type { Ctx } from "../main";
import { fmtInt, fmtMs } from "../format";
import { h, section, table, type Col } from "../util";

interface Side {
  count: number;
  p50_ms: number | null;
  p95_ms: number | null;
}

interface Row {
  endpoint: string;
  a: Side;
  b: Side;
  p50_change: number | null;
  p95_change: number | null;
  q_value: number | null;
  significant: boolean;
  verdict: "faster" | "slower" | "same" | "too_few";
}

interface Report {
  name: string;
  run_id: string;
  rate: number | null;
  concurrency: number | null;
  achieved_rate: number | null;
  measured_ticks: number;
  warmup: number;
  sides: Record<string, Side & { target: string; errors: number }>;
  endpoints: (Row | (Side & { endpoint: string }))[];
  verdict?: string;
}

const COLOR: Record<string, string> = { faster: "#2e7d32", slower: "#c62828", same: "inherit", too_few: "#888" };
const pct = (v: number | null) => (v === null ? "-" : `${v > 0 ? "+" : ""}${(v * 100).toFixed(0)} %`);

export async function loadPage(root: HTMLElement, ctx: Ctx): Promise<void> {
  const runs = await get("/api/load");
  if (!runs.length) {
    root.append(section("Load", h("p", { class: "dim" }, "No load runs yet: run `perfsleuth load --a URL --b URL --rate N` with this data directory.")));
    return;
  }
  const name = ctx.params.get("run") || runs[0].name;
  const r = await api<Report>(`load/${encodeURIComponent(name)}`);
  root.append(
    h(
      "div",
      { class: "controls" },
      "run ",
      h("select", { "data-pick": "run", onchange: (e: Event) => ctx.set({ run: (e.target as HTMLSelectElement).value }) }, runs.map((x) => h("option", { value: x.name, selected: x.name === name }, x.name))),
    ),
    h("p", { class: "verdict-line" }, r.verdict ?? "one target: no verdict"),
    h(
      "p",
      { class: "dim load-rate" },
      `${fmtInt(r.measured_ticks)} measured requests per target` + (r.achieved_rate ? ` at ${r.achieved_rate.toFixed(1)}/s` : "") + (r.rate ? ` (asked ${r.rate}/s)` : ` (${r.concurrency} workers)`) + `, ${r.warmup} warm-up; header X-Perfsleuth-Load: ${r.run_id};<side>`,
    ),
    h("ul", {}, Object.entries(r.sides).map(([s, v]) => h("li", { "data-side": s }, `${s}: ${v.target} · p50 ${fmtMs(v.p50_ms)} ms · p95 ${fmtMs(v.p95_ms)} ms · errors ${v.errors}`))),
  );
  if (r.verdict) {
    const cols: Col<Row>[] = [
      { key: "endpoint", label: "endpoint" },
      { key: "verdict", label: "verdict", value: (x) => x.verdict, render: (x) => h("span", { style: { color: COLOR[x.verdict], fontWeight: x.significant ? "600" : "400" } }, x.verdict) },
      { key: "n_a", label: "n a", num: true, value: (x) => x.a.count },
      { key: "p50_a", label: "p50 a", num: true, value: (x) => x.a.p50_ms, render: (x) => fmtMs(x.a.p50_ms) },
      { key: "p95_a", label: "p95 a", num: true, value: (x) => x.a.p95_ms, render: (x) => fmtMs(x.a.p95_ms) },
      { key: "n_b", label: "n b", num: true, value: (x) => x.b.count },
      { key: "p50_b", label: "p50 b", num: true, value: (x) => x.b.p50_ms, render: (x) => fmtMs(x.b.p50_ms) },
      { key: "p95_b", label: "p95 b", num: true, value: (x) => x.b.p95_ms, render: (x) => fmtMs(x.b.p95_ms) },
      { key: "p50_change", label: "p50 change", num: true, value: (x) => x.p50_change, render: (x) => pct(x.p50_change) },
      { key: "p95_change", label: "p95 change", num: true, value: (x) => x.p95_change, render: (x) => pct(x.p95_change) },
      { key: "q", label: "q", num: true, value: (x) => x.q_value, render: (x) => (x.q_value === null ? "-" : x.q_value.toPrecision(2)) },
    ];
    root.append(section("Per endpoint (b against a)", table(cols, r.endpoints as Row[], { cls: "grid load-table", rowAttrs: (x) => ({ "data-endpoint": x.endpoint, "data-verdict": x.verdict }) })));
  } else {
    const cols: Col<Side & { endpoint: string }>[] = [
      { key: "endpoint", label: "endpoint" },
      { key: "count", label: "n", num: true },
      { key: "p50_ms", label: "p50", num: true, render: (x) => fmtMs(x.p50_ms) },
      { key: "p95_ms", label: "p95", num: true, render: (x) => fmtMs(x.p95_ms) },
    ];
    root.append(section("Per endpoint", table(cols, r.endpoints as (Side & { endpoint: string })[], { cls: "grid load-table", rowAttrs: (x) => ({ "data-endpoint": x.endpoint }) })));
  }
}
