// Start-up: a saved `perfsleuth startup` run: the phases of the path to the first answer (they
// add up to the total), the ranked import tree with the app's modules marked, the first request
// against the steady state, the notes, and the change per phase against another run.
import { api, get } from "../api";
import type { Ctx } from "../main";
import { fmtMs } from "../format";
import { h, bar, section, table, type Col } from "../util";

interface Phase {
  phase: string;
  ms: number;
  share: number;
  top: { name: string; ms: number }[];
}

interface ImportNode {
  name: string;
  self_ms: number;
  cum_ms: number;
  app: boolean;
  children: ImportNode[];
}

interface CompareRow {
  phase: string;
  before_ms: number;
  after_ms: number;
  change_ms: number;
}

interface Report {
  name: string;
  command: string[];
  url: string;
  total_ms: number;
  phases: Phase[];
  imports: { tree: ImportNode[]; slowest: { name: string; self_ms: number; cum_ms: number; app: boolean }[]; count: number; total_ms: number };
  first_request: { ms: number; steady_p50_ms: number | null; ratio: number | null; lazy_imports: string[] };
  notes: string[];
  compare?: { before: string; phases: CompareRow[]; total: { before_ms: number; after_ms: number; change_ms: number } };
}

function importTree(nodes: ImportNode[], depth: number): HTMLElement {
  return h(
    "ul",
    { class: "import-tree" },
    nodes.slice(0, depth === 0 ? 15 : 6).map((n) =>
      h(
        "li",
        { "data-module": n.name, "data-app": n.app ? "1" : undefined },
        h("span", { class: "mono" }, n.name),
        n.app ? h("span", { class: "tag app-tag" }, " app") : null,
        h("span", { class: "dim" }, ` ${fmtMs(n.cum_ms)} ms (self ${fmtMs(n.self_ms)})`),
        n.children.length && depth < 3 ? importTree(n.children.filter((c) => c.cum_ms >= 1), depth + 1) : null,
      ),
    ),
  );
}

export async function startupPage(root: HTMLElement, ctx: Ctx): Promise<void> {
  const runs = await get("/api/startup");
  if (!runs.length) {
    root.append(
      section("Start-up", h("p", { class: "dim" }, "No start-up runs yet: run `perfsleuth startup --url URL -- CMD` with this data directory.")),
    );
    return;
  }
  const name = ctx.params.get("run") || runs[0].name;
  const against = ctx.params.get("against") || "";
  const report = await api<Report>(`startup/${encodeURIComponent(name)}`, { compare: against || undefined });
  const pick = (key: string, value: string, none?: string) =>
    h(
      "select",
      { "data-pick": key, onchange: (e: Event) => ctx.set({ [key]: (e.target as HTMLSelectElement).value }) },
      none !== undefined ? h("option", { value: "", selected: !value }, none) : null,
      runs.map((r) => h("option", { value: r.name, selected: r.name === value }, `${r.name} · ${fmtMs(r.total_ms)} ms`)),
    );
  root.append(
    h("div", { class: "controls" }, "run ", pick("run", name), " against ", pick("against", against, "(none)")),
    h("p", { class: "verdict-line", "data-total": report.total_ms }, `${fmtMs(report.total_ms)} ms from launch to the first answer of ${report.url}`),
    h("p", { class: "mono dim" }, report.command.join(" ")),
  );
  const cols: Col<Phase>[] = [
    { key: "phase", label: "phase" },
    { key: "ms", label: "ms", num: true, render: (p) => fmtMs(p.ms) },
    { key: "share", label: "share", render: (p) => bar(p.share) },
    { key: "top", label: "mostly", render: (p) => p.top.slice(0, 3).map((t) => `${t.name} ${fmtMs(t.ms)}`).join(", ") },
  ];
  root.append(section("Phases (they add up to the total)", table(cols, report.phases, { cls: "grid startup-phases", rowAttrs: (p) => ({ "data-phase": p.phase }) })));
  const fr = report.first_request;
  root.append(
    section(
      "First request",
      h(
        "p",
        { class: "first-request" },
        `${fmtMs(fr.ms)} ms against a steady ${fmtMs(fr.steady_p50_ms)} ms` + (fr.ratio ? ` (${fr.ratio}x)` : "") + (fr.lazy_imports.length ? `; it imported ${fr.lazy_imports.slice(0, 5).join(", ")}` : ""),
      ),
    ),
  );
  if (report.notes.length) root.append(section("What ran one after another", h("ul", { class: "notes" }, report.notes.map((n) => h("li", {}, n)))));
  root.append(
    section(
      `Imports: ${report.imports.count} modules, ${fmtMs(report.imports.total_ms)} ms`,
      h(
        "ol",
        { class: "slowest-imports" },
        report.imports.slowest.slice(0, 8).map((s) => h("li", { "data-module": s.name }, h("span", { class: "mono" }, s.name), s.app ? h("span", { class: "tag app-tag" }, " app") : null, ` self ${fmtMs(s.self_ms)} ms`)),
      ),
      importTree(report.imports.tree, 0),
    ),
  );
  if (report.compare) {
    const c = report.compare;
    const ccols: Col<CompareRow>[] = [
      { key: "phase", label: "phase" },
      { key: "before_ms", label: `before (${c.before})`, num: true, render: (r) => fmtMs(r.before_ms) },
      { key: "after_ms", label: "this run", num: true, render: (r) => fmtMs(r.after_ms) },
      { key: "change_ms", label: "change ms", num: true, render: (r) => (r.change_ms > 0 ? "+" : "") + fmtMs(r.change_ms) },
    ];
    const rows = [...c.phases.filter((r) => r.before_ms || r.after_ms), { phase: "total", ...c.total }];
    root.append(section("Against the earlier run", table(ccols, rows, { cls: "grid startup-compare", rowAttrs: (r) => ({ "data-phase": r.phase }) })));
  }
}
