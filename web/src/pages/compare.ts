// Compare: two time ranges, or two values of a tag / attribute / release, per endpoint with the
// verdict line, the table (intervals, change, q-value, what moved) and the two latency
// distributions of the chosen endpoint overlaid.
import { get, type CompareRow, type FindingBrief, type Histogram, type SideStats } from "../api";
import type { Ctx } from "../main";
import { fmtInt, fmtMs } from "../format";
import { h, section, table, type Col } from "../util";

type Row = CompareRow;
type Brief = FindingBrief;
type Hist = Histogram;

const COLORS = { a: "#1f77b4", b: "#d62728" };
const VERDICT_COLOR: Record<string, string> = { slower: "#c0392b", faster: "#1e8449", same: "", too_few: "#888" };
const MOVED_SHOWN: [string, string][] = [
  ["db_calls", "db"],
  ["http_calls", "http"],
  ["cache_calls", "cache"],
  ["rows", "rows"],
  ["cpu_ms", "cpu ms"],
  ["gc_ms", "gc ms"],
];

function pct(v: number | null | undefined): string {
  if (v === null || v === undefined || !isFinite(v)) return "-";
  return `${v >= 0 ? "+" : ""}${(v * 100).toFixed(0)} %`;
}

function withCi(s: SideStats, name: string): string {
  const v = (s as unknown as Record<string, number | null>)[`${name}_ms`];
  const ci = s.ci?.[`${name}_ms`];
  if (v === null || v === undefined) return "-";
  return ci ? `${fmtMs(v)} [${fmtMs(ci[0])}–${fmtMs(ci[1])}]` : fmtMs(v);
}

function movedText(r: Row): string {
  const parts: string[] = [];
  for (const [key, label] of MOVED_SHOWN) {
    const m = r.moved?.[key];
    if (!m || m.a === null || m.b === null) continue;
    if (Math.abs(m.b - m.a) < Math.max(0.5, 0.1 * Math.abs(m.a))) continue;
    parts.push(`${label} ${m.a.toFixed(1)}→${m.b.toFixed(1)}`);
  }
  for (const f of r.findings_gone ?? []) parts.push(`gone: ${f.kind}`);
  for (const f of r.findings_appeared ?? []) parts.push(`new: ${f.kind}`);
  return parts.join(", ");
}

/** The two sides' latency distributions (shares of their requests per log-spaced bin) as two
 * filled step lines over one axis. */
function overlay(endpoint: string, hist: Hist, labels: { a: string; b: string }): HTMLElement {
  const W = 900;
  const H = 220;
  const PAD = 28;
  const n = hist.a.length;
  const max = Math.max(1e-9, ...hist.a, ...hist.b);
  const x = (i: number) => PAD + ((W - 2 * PAD) * i) / n;
  const y = (v: number) => H - PAD - ((H - 2 * PAD) * v) / max;
  const path = (vals: number[]) => {
    let d = `M ${x(0)} ${y(0)}`;
    vals.forEach((v, i) => (d += ` L ${x(i)} ${y(v)} L ${x(i + 1)} ${y(v)}`));
    return d + ` L ${x(n)} ${y(0)} Z`;
  };
  const ns = "http://www.w3.org/2000/svg";
  const svg = document.createElementNS(ns, "svg");
  svg.setAttribute("viewBox", `0 0 ${W} ${H}`);
  svg.setAttribute("width", "100%");
  svg.setAttribute("class", "compare-dist");
  for (const side of ["a", "b"] as const) {
    const p = document.createElementNS(ns, "path");
    p.setAttribute("d", path(hist[side]));
    p.setAttribute("fill", COLORS[side] + "33");
    p.setAttribute("stroke", COLORS[side]);
    p.setAttribute("stroke-width", "1.5");
    p.setAttribute("data-side", side);
    svg.append(p);
  }
  const ticks = [0, Math.floor(n / 4), Math.floor(n / 2), Math.floor((3 * n) / 4), n];
  for (const i of ticks) {
    const t = document.createElementNS(ns, "text");
    t.setAttribute("x", String(x(i)));
    t.setAttribute("y", String(H - 8));
    t.setAttribute("font-size", "11");
    t.setAttribute("text-anchor", "middle");
    t.setAttribute("fill", "#666");
    t.textContent = `${fmtMs(hist.edges[i])} ms`;
    svg.append(t);
  }
  const legend = h(
    "div",
    { class: "row" },
    h("span", { style: { color: COLORS.a, fontWeight: "600" } }, `■ a: ${labels.a}`),
    h("span", { style: { color: COLORS.b, fontWeight: "600" } }, `■ b: ${labels.b}`),
    h("span", { class: "dim" }, "share of each side's requests per latency bin (log scale)"),
  );
  return h("div", { class: "chart-card", id: "compare-chart", "data-endpoint": endpoint }, h("div", { class: "chart-title" }, `Latency of ${endpoint}`), legend, svg);
}

function form(ctx: Ctx): HTMLElement {
  const p = ctx.params;
  const input = (id: string, value: string, placeholder: string, size = 34) => h("input", { id, value, placeholder, size }) as HTMLInputElement;
  const a = input("cmp-a", p.get("a") ?? "", "a: 2026-11-20T10:00/2026-11-20T11:00, last-2h, or a value");
  const b = input("cmp-b", p.get("b") ?? "", "b: last-1h, or a value");
  const by = input("cmp-by", p.get("by") ?? "", "by: tag:NAME, attr:NAME, release (optional)", 28);
  const win = input("cmp-window", p.get("window") ?? "", "window with by (optional): last-24h", 26);
  const go = () => ctx.set({ a: a.value.trim(), b: b.value.trim(), by: by.value.trim(), window: win.value.trim(), endpoint: undefined });
  for (const el of [a, b, by, win]) el.addEventListener("keydown", (e) => e.key === "Enter" && go());
  return section(
    "Compare two time ranges, or the values of a tag, attribute or release",
    h("div", { class: "row" }, a, b),
    h("div", { class: "row" }, by, win, h("button", { id: "cmp-go", onclick: go }, "Compare")),
    h("div", { class: "dim" }, "With by, a and b are values (empty: the two most common). Times are UTC. b is compared against a."),
  );
}

export async function comparePage(root: HTMLElement, ctx: Ctx): Promise<void> {
  const p = ctx.params;
  root.append(form(ctx));
  const by = p.get("by") ?? "";
  if (!by && !(p.get("a") && p.get("b"))) {
    root.append(h("p", { class: "dim" }, "Give two time ranges (a and b), or a tag to compare its values (by)."));
    return;
  }
  const res = await get("/api/compare", { a: p.get("a") ?? undefined, b: p.get("b") ?? undefined, by: by || undefined, window: p.get("window") ?? undefined });
  root.append(h("div", { class: "card verdict", id: "compare-verdict", style: { fontWeight: "600", fontSize: "15px" } }, res.verdict));
  const chosen = p.get("endpoint") ?? res.endpoints.find((r) => res.histograms[r.endpoint])?.endpoint ?? "";
  const cols: Col<Row>[] = [
    { key: "endpoint", label: "endpoint", render: (r) => h("a", { href: "javascript:void 0", onclick: () => ctx.set({ endpoint: r.endpoint }) }, r.endpoint) },
    { key: "verdict", label: "verdict", value: (r) => r.verdict, render: (r) => h("span", { style: { color: VERDICT_COLOR[r.verdict], fontWeight: r.significant ? "600" : "400" } }, r.verdict) },
    { key: "n_a", label: "n a", num: true, value: (r) => r.a.count, render: (r) => fmtInt(r.a.count) },
    { key: "n_b", label: "n b", num: true, value: (r) => r.b.count, render: (r) => fmtInt(r.b.count) },
    { key: "p50_a", label: "p50 a", num: true, value: (r) => r.a.p50_ms, render: (r) => fmtMs(r.a.p50_ms) },
    { key: "p50_b", label: "p50 b", num: true, value: (r) => r.b.p50_ms, render: (r) => fmtMs(r.b.p50_ms) },
    { key: "p95_a", label: "p95 a [95 % CI]", num: true, value: (r) => r.a.p95_ms, render: (r) => withCi(r.a, "p95") },
    { key: "p95_b", label: "p95 b [95 % CI]", num: true, value: (r) => r.b.p95_ms, render: (r) => withCi(r.b, "p95") },
    { key: "p95_change", label: "p95 change", num: true, value: (r) => r.p95_change, render: (r) => pct(r.p95_change) + (r.p95_change_pm !== null && isFinite(r.p95_change_pm) ? ` ±${(r.p95_change_pm * 100).toFixed(0)}` : "") },
    { key: "q", label: "q", num: true, value: (r) => r.q_value, render: (r) => (r.q_value === null ? "-" : r.q_value.toPrecision(2)), title: "Benjamini-Hochberg adjusted p-value of the rank test" },
    { key: "moved", label: "moved with it", value: (r) => movedText(r) },
  ];
  root.append(
    section(
      `${res.b} against ${res.a}`,
      table(cols, res.endpoints, { cls: "grid compare-table", rowAttrs: (r) => ({ "data-endpoint": r.endpoint, "data-verdict": r.verdict, class: r.endpoint === chosen ? "selected" : "" }) }),
    ),
  );
  if (chosen && res.histograms[chosen]) root.append(overlay(chosen, res.histograms[chosen], { a: res.a, b: res.b }));
  const f = res.findings;
  if (f.gone.length || f.appeared.length) {
    const list = (items: Brief[], cls: string) => h("ul", { class: cls }, items.map((x) => h("li", { "data-kind": x.kind }, h("span", { class: "kind" }, x.kind), " ", x.endpoint, ": ", x.title)));
    root.append(section(`Findings in ${res.b}`, f.gone.length ? h("div", {}, h("b", {}, "gone"), list(f.gone, "findings-gone")) : null, f.appeared.length ? h("div", {}, h("b", {}, "appeared"), list(f.appeared, "findings-appeared")) : null));
  }
}
