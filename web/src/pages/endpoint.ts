import { get, type CallTreeNode, type ProfileNode, type TraceRow, type WhoRow } from "../api";
import { timeChart, histogram } from "../charts";
import { treemapView, flameGraph } from "../hier";
import type { Ctx } from "../main";
import { findingList } from "./findings";
import { fmtInt, fmtMs, fmtPct } from "../format";
import { h, fmtMsShort, fmtNum, fmtTime, table, link, section, errorBox, type Col } from "../util";

export function tracesTable(ctx: Ctx, rows: TraceRow[]): HTMLElement {
  const cols: Col<TraceRow>[] = [
    { key: "trace_id", label: "trace", render: (r) => link(ctx.href("trace", { id: r.trace_id }), r.trace_id, { class: "trace-link mono" }) },
    { key: "ts", label: "time (UTC)", render: (r) => fmtTime(r.ts) },
    { key: "duration_ms", label: "ms", num: true, render: (r) => fmtMs(r.duration_ms) },
    { key: "status", label: "status", num: true },
    { key: "db_calls", label: "DB calls", num: true, render: (r) => fmtInt(r.db_calls) },
    { key: "db_ms", label: "DB ms", num: true, render: (r) => fmtMs(r.db_ms) },
    { key: "http_calls", label: "HTTP", num: true, render: (r) => fmtInt(r.http_calls) },
    { key: "http_ms", label: "HTTP ms", num: true, render: (r) => fmtMs(r.http_ms) },
    { key: "user", label: "user" },
    { key: "tenant", label: "tenant" },
  ];
  return table(cols, rows);
}

export async function endpointPage(root: HTMLElement, ctx: Ctx): Promise<void> {
  const name = ctx.params.get("name") || "";
  const kind = ctx.params.get("kind") || "db";
  if (!name) throw new Error("no endpoint given: pick one on the overview");
  // The detectors can take seconds on big data: their section fills in when they answer.
  const [d, tree, prof] = await Promise.all([
    get("/api/endpoint", { name, since: ctx.since, host: ctx.host, service: ctx.service }),
    get("/api/calltree", { endpoint: name, kind, since: ctx.since }).catch((e: Error) => e),
    get("/api/profile", { endpoint: name, since: ctx.since }).catch((e: Error) => e),
  ]);
  // Asked after the rest: the server answers one question at a time, and this one is slow.
  const foundBox = h("div", { id: "endpoint-findings" }, h("span", { class: "dim" }, "running the detectors…"));
  get("/api/findings", { endpoint: name, since: ctx.since }).then(
    (found) => foundBox.replaceChildren(findingList(ctx, found, null)),
    (e) => foundBox.replaceChildren(errorBox(e)),
  );
  const s = d.summary;
  root.append(
    h("h1", { id: "endpoint-name" }, d.endpoint),
    ctx.host || ctx.service
      ? h(
          "p",
          { class: "dim", id: "fleet-note" },
          `Only ${[ctx.host && `host ${ctx.host}`, ctx.service && `service ${ctx.service}`].filter(Boolean).join(", ")} (the filters above) in the summary, charts, calls and slowest requests; the findings, call tree and profile are of every host.`,
        )
      : "",
    s
      ? h(
          "div",
          { class: "cards" },
          ...(
            [
              ["count", fmtInt(s.count)],
              ["rate/min", fmtNum(s.rate_per_min, s.rate_per_min < 1 ? 2 : 1)],
              ["p50 ms", fmtMs(s.p50_ms)],
              ["p95 ms", fmtMs(s.p95_ms)],
              ["p99 ms", fmtMs(s.p99_ms)],
              ["errors", fmtPct(s.error_rate)],
              ["DB calls/req", fmtNum(s.db_calls_per_request)],
              ["in DB", fmtPct(s.db_share)],
              ["in HTTP", fmtPct(s.http_share)],
            ] as [string, string][]
          ).map(([l, v]) => h("div", { class: "stat", "data-stat": l }, h("div", { class: "stat-value" }, v), h("div", { class: "stat-label" }, l))),
        )
      : h("p", { class: "dim" }, `No requests of this endpoint in the last ${ctx.since}.`),
  );
  root.append(
    h(
      "div",
      { class: "charts two" },
      timeChart("Latency percentiles (ms)", d.percentiles.x, [
        { label: "p50", values: d.percentiles.p50, unit: " ms" },
        { label: "p95", values: d.percentiles.p95, unit: " ms" },
        { label: "p99", values: d.percentiles.p99, unit: " ms" },
        { label: "requests", values: d.percentiles.count, scale: "y2", bars: true, color: "#999999" },
      ], { y2Label: "requests" }),
      h("div", { class: "chart-card" }, h("div", { class: "chart-title" }, "Latency histogram (ms, log bins)"), histogram(d.histogram, fmtMsShort)),
    ),
  );

  // Findings for this endpoint come first: they name the problem.
  root.append(section("Findings for this endpoint", foundBox));

  const treeBox = h("div", { class: "treemap-box" });
  const kinds = h(
    "span",
    { class: "tabs" },
    ["db", "http", "cache"].map((k) => h("a", { href: ctx.href("endpoint", { name, kind: k }), class: k === kind ? "active" : "" }, k)),
  );
  root.append(h("section", { class: "card" }, h("div", { class: "row" }, h("h2", {}, "Call sites (where the calls come from; area = time)"), kinds), treeBox));
  requestAnimationFrame(() => {
    if (tree instanceof Error) treeBox.append(errorBox(tree));
    else if (!tree.calls) treeBox.append(h("p", { class: "dim" }, `No ${kind} calls in this window.`));
    else {
      // A click on a box zooms into that call path; a click on the outer box goes back up.
      const width = Math.max(400, treeBox.clientWidth);
      const crumb = h("div", { class: "dim mono crumb" });
      const map = h("div", {});
      const draw = (node: CallTreeNode, path: CallTreeNode[]) => {
        crumb.textContent = [...path, node].map((n) => n.name).join(" › ");
        map.replaceChildren(
          treemapView(node, width, 420, (picked) => {
            if (picked === node && path.length) draw(path[path.length - 1], path.slice(0, -1));
            else if (picked !== node) {
              // the path down to the picked node
              const trail: CallTreeNode[] = [];
              const find = (n: CallTreeNode): boolean => {
                if (n === picked) return true;
                for (const c of n.children ?? []) {
                  if (find(c)) {
                    trail.unshift(c);
                    return true;
                  }
                }
                return false;
              };
              find(node);
              trail.pop();
              draw(picked, [...path, node, ...trail]);
            }
          }),
        );
      };
      draw(tree, []);
      treeBox.append(crumb, map);
    }
  });

  const flameBox = h("div", { class: "flame-box" });
  root.append(section("Flame graph of slow-request stack samples", flameBox));
  requestAnimationFrame(() => {
    if (prof instanceof Error) flameBox.append(errorBox(prof));
    else if (!prof.samples) flameBox.append(h("p", { class: "dim" }, "No stack samples: the agent samples requests slower than its threshold."));
    else {
      const states = Object.entries(prof.states).map(([k, v]) => `${k} ${fmtInt(v)}`).join(", ");
      const width = Math.max(400, flameBox.clientWidth);
      const graph = h("div", { class: "flame-graph" });
      // A click on a frame zooms into it; a click on the top frame goes back up one level.
      const draw = (node: ProfileNode, path: ProfileNode[]) => {
        graph.replaceChildren(
          flameGraph(node, width, (picked) => {
            if (picked === node && path.length) draw(path[path.length - 1], path.slice(0, -1));
            else if (picked !== node) draw(picked, [...path, node]);
          }),
        );
      };
      draw(prof.tree, []);
      flameBox.append(h("div", { class: "dim" }, `${fmtInt(prof.samples)} samples of ${fmtInt(prof.requests)} requests (${states}); hover a frame for details, click to zoom in (the top frame zooms out)`), graph);
      flameBox.append(
        h("h3", {}, "Top functions (self time)"),
        table(
          [
            { key: "function", label: "function" },
            { key: "file", label: "where", render: (r) => `${(r.file ?? "?").split("/").slice(-2).join("/")}:${r.line ?? "?"}` },
            { key: "self_share", label: "self", num: true, render: (r) => fmtPct(r.self_share) },
            { key: "total_share", label: "total", num: true, render: (r) => fmtPct(r.total_share) },
          ],
          prof.top.slice(0, 10),
        ),
      );
    }
  });

  root.append(
      section(
        "Top statements",
        d.fingerprints.length
          ? table(
              [
                { key: "statement", label: "statement", render: (r) => h("code", { class: "stmt", title: r.statement ?? "" }, r.statement ?? "?") },
                { key: "kind", label: "kind" },
                { key: "calls_per_request", label: "per req", num: true, render: (r) => fmtNum(r.calls_per_request) },
                { key: "total_ms", label: "total ms", num: true, render: (r) => fmtMs(r.total_ms) },
                { key: "p95_ms", label: "p95 ms", num: true, render: (r) => fmtMs(r.p95_ms) },
                { key: "avg_rows", label: "rows", num: true, render: (r) => fmtNum(r.avg_rows) },
              ],
              d.fingerprints,
            )
          : h("p", { class: "dim" }, "No calls."),
      ),
  );
  root.append(
      section(
        "Upstream hosts (HTTP)",
        d.hosts.length
          ? table(
              [
                { key: "host", label: "host" },
                { key: "calls", label: "calls", num: true, render: (r) => fmtInt(r.calls) },
                { key: "total_ms", label: "total ms", num: true, render: (r) => fmtMs(r.total_ms) },
                { key: "p95_ms", label: "p95 ms", num: true, render: (r) => fmtMs(r.p95_ms) },
                { key: "errors", label: "errors", num: true, render: (r) => fmtInt(r.errors) },
              ],
              d.hosts,
            )
          : h("p", { class: "dim" }, "No HTTP calls."),
      ),
  );
  root.append(section("Slowest requests", d.slowest.length ? tracesTable(ctx, d.slowest) : h("p", { class: "dim" }, "None.")));
  const whoCols: Col<WhoRow>[] = [
    { key: "name", label: "name" },
    { key: "count", label: "requests", num: true, render: (r) => fmtInt(r.count) },
    { key: "total_ms", label: "total ms", num: true, render: (r) => fmtMs(r.total_ms) },
    { key: "p95_ms", label: "p95 ms", num: true, render: (r) => fmtMs(r.p95_ms) },
  ];
  root.append(
    h(
      "div",
      { class: "two" },
      section("Top users", d.users.length ? table(whoCols, d.users) : h("p", { class: "dim" }, "No users recorded.")),
      section("Top tenants", d.tenants.length ? table(whoCols, d.tenants) : h("p", { class: "dim" }, "No tenants recorded.")),
    ),
  );
}
