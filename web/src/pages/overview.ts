import { get, type Fleet, type FleetSource, type TopRow } from "../api";
import { timeChart, PALETTE } from "../charts";
import type { Ctx } from "../main";
import { fmtInt, fmtMs, fmtPct } from "../format";
import { h, fmtNum, fmtTime, bar, table, link, type Col } from "../util";

export async function overviewPage(root: HTMLElement, ctx: Ctx): Promise<void> {
  // ctx.fleet is the header's fetch (null when it failed: no fleet card, the page still shows)
  const [data, fleet] = await Promise.all([
    get("/api/overview", { since: ctx.since, host: ctx.host, service: ctx.service }),
    ctx.fleet.catch(() => null),
  ]);
  const sort = ctx.params.get("sort") || "total_ms";
  const desc = ctx.params.get("dir") !== "asc";
  const filter = ctx.params.get("filter") || "";

  const slow1 = data.slow.totals[0];
  root.append(
    h(
      "div",
      { class: "cards" },
      stat("requests", fmtInt(data.totals.requests), "totals-requests"),
      stat("endpoints", fmtInt(data.totals.endpoints), "totals-endpoints"),
      stat("errors", fmtInt(data.totals.errors), "totals-errors"),
      ...data.slow.totals.map((t) => stat(`over ${t.threshold_ms / 1000} s (week ago)`, `${fmtInt(t.now)} (${fmtInt(t.week_ago)})`, `slow-${t.threshold_ms}`)),
    ),
  );
  void slow1;

  const charts = h("div", { class: "charts" });
  charts.append(
    timeChart(
      "P95 per endpoint (ms) — the top endpoints by time",
      data.p95.x,
      data.p95.series.map((s, i) => ({ label: s.endpoint, values: s.values, color: PALETTE[i % PALETTE.length], unit: " ms" })),
      { height: 240 },
    ),
    timeChart(
      "Throughput and errors (requests per bucket)",
      data.throughput.x,
      [
        { label: "requests", values: data.throughput.requests, color: "#1f77b4", bars: true },
        { label: "errors", values: data.throughput.errors, color: "#d62728", scale: "y2" },
      ],
      { height: 240, y2Label: "errors" },
    ),
    timeChart(
      "Slow requests: over 1 s / 2 s / 5 s, now (solid) and the same hours a week earlier (dashed)",
      data.slow.x,
      data.slow.thresholds.flatMap((t, i) => [
        { label: `> ${t / 1000} s`, values: data.slow.now[String(t)], color: PALETTE[i + 1] },
        { label: `> ${t / 1000} s week ago`, values: data.slow.week_ago[String(t)], color: PALETTE[i + 1], dash: [4, 4] },
      ]),
      { height: 240 },
    ),
  );
  root.append(charts);
  if (fleet && (fleet.sources.length > 1 || ctx.host || ctx.service)) root.append(fleetCard(ctx, fleet));

  const input = h("input", { type: "search", placeholder: "filter endpoints…", value: filter, class: "filter", id: "endpoint-filter" }) as HTMLInputElement;
  input.addEventListener("change", () => ctx.set({ filter: input.value }));
  const rows = data.endpoints.filter((r) => r.endpoint.toLowerCase().includes(filter.toLowerCase()));
  const key = sort as keyof TopRow;
  rows.sort((a, b) => {
    const x = a[key] ?? -Infinity;
    const y = b[key] ?? -Infinity;
    const c = typeof x === "string" ? String(x).localeCompare(String(y)) : (x as number) - (y as number);
    return desc ? -c : c;
  });
  const cols: Col<TopRow>[] = [
    { key: "endpoint", label: "endpoint", render: (r) => link(ctx.href("endpoint", { name: r.endpoint }), r.endpoint, { class: "endpoint-link" }) },
    { key: "count", label: "count", num: true, render: (r) => fmtInt(r.count) },
    { key: "rate_per_min", label: "rate/min", num: true, render: (r) => fmtNum(r.rate_per_min, r.rate_per_min < 1 ? 2 : 1) },
    { key: "p50_ms", label: "p50 ms", num: true, render: (r) => fmtMs(r.p50_ms) },
    { key: "p95_ms", label: "p95 ms", num: true, render: (r) => fmtMs(r.p95_ms) },
    { key: "p99_ms", label: "p99 ms", num: true, render: (r) => fmtMs(r.p99_ms) },
    { key: "error_rate", label: "errors", num: true, render: (r) => fmtPct(r.error_rate) },
    { key: "db_calls_per_request", label: "DB calls/req", num: true, render: (r) => fmtNum(r.db_calls_per_request) },
    { key: "http_calls_per_request", label: "HTTP/req", num: true, render: (r) => fmtNum(r.http_calls_per_request) },
    { key: "db_share", label: "in DB", num: true, render: (r) => fmtPct(r.db_share) },
    { key: "time_share", label: "time share", num: true, render: (r) => bar(r.time_share), title: "share of all request time in the window" },
  ];
  const onSort = (k: string) => ctx.set({ sort: k, dir: k === sort && desc ? "asc" : undefined });
  root.append(
    h(
      "section",
      { class: "card" },
      h("div", { class: "row" }, h("h2", {}, `Endpoints (${rows.length} of ${data.endpoints.length})`), input),
      rows.length ? table(cols, rows, { sort, desc, onSort, cls: "grid", rowAttrs: (r) => ({ "data-endpoint": r.endpoint }) }) : h("p", { class: "dim" }, `No requests in ${ctx.since === "all" ? "the store" : "the last " + ctx.since}. Try a longer range, or run your app under \`perfsleuth run -- …\`: this server ingests what it records every few seconds.`),
    ),
  );
}

/** Who sent requests: a row per host and service, with its tokens; a host or service sets the
 * page's filter. "(none)" (requests without a host or service, e.g. OTLP without host.name) is
 * not a link: its filter value "" means all. */
function fleetCard(ctx: Ctx, fleet: Fleet): HTMLElement {
  const pick = (value: string, to: Record<string, string>, cls: string) =>
    value ? link(ctx.href("overview", to), value, { class: cls }) : h("span", { class: "dim" }, "(none)");
  const cols: Col<FleetSource>[] = [
    { key: "host", label: "host", render: (r) => pick(r.host, { host: r.host, service: ctx.service }, "host-link") },
    { key: "service", label: "service", render: (r) => pick(r.service, { host: ctx.host, service: r.service }, "service-link") },
    { key: "requests", label: "requests", num: true, render: (r) => fmtInt(r.requests) },
    { key: "processes", label: "processes", num: true, render: (r) => fmtInt(r.processes) },
    { key: "last", label: "last request (UTC)", render: (r) => fmtTime(r.last) },
    { key: "tokens", label: "tokens", render: (r) => r.tokens.join(", ") || "-" },
    { key: "via", label: "via", render: (r) => r.via.join(", ") || "local spool" },
  ];
  const shown = fleet.sources.filter((r) => (!ctx.host || r.host === ctx.host) && (!ctx.service || r.service === ctx.service));
  const what = [ctx.host && `host ${ctx.host}`, ctx.service && `service ${ctx.service}`].filter(Boolean).join(", ");
  return h(
    "section",
    { class: "card", id: "fleet" },
    h(
      "div",
      { class: "row" },
      h("h2", {}, what ? `Fleet: showing ${what}` : `Fleet (${fleet.sources.length} host/service pairs)`),
      what ? link(ctx.href("overview", { host: "", service: "" }), "show all", { id: "fleet-clear" }) : "",
    ),
    table(cols, shown, { cls: "grid", rowAttrs: (r) => ({ "data-host": r.host, "data-service": r.service }) }),
  );
}

function stat(label: string, value: string, id: string): HTMLElement {
  return h("div", { class: "stat", id }, h("div", { class: "stat-value" }, value), h("div", { class: "stat-label" }, label));
}
