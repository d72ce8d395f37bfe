import { get, type Finding } from "../api";
import type { Ctx } from "../main";
import { fmtInt, fmtMs } from "../format";
import { h, fmtNum, site, link, section } from "../util";

// How sure a finding is (high / medium / low) and the evidence counts it rests on.
function confidenceNote(f: Finding): string {
  const counts = Object.entries(f.confidence_basis).map(
    ([k, b]) => `${fmtInt(b.count)} ${k.replace(/_/g, " ")} (floor ${fmtInt(b.floor)})`,
  );
  return [f.confidence ?? "unrated", counts.join(", ")].filter(Boolean).join(": ");
}

// The endpoint of a finding about the whole service (cpu_starved, gc_pressure's heap).
const SERVICE = "<service>";

type Where = { file?: string | null; line?: number | null; function?: string | null };

// The template expression a call ran from and the {% for %} around it (evidence.template).
function templateNote(f: Finding): HTMLElement | null {
  const t = f.evidence.template as { expression?: Where; loop?: Where | null } | null | undefined;
  if (!t?.expression) return null;
  const text = `template: ${site(t.expression)}${t.loop ? ` in ${site(t.loop)}` : ""}`;
  return h("div", { class: "mono template-lines", title: t.expression.file ?? "" }, text);
}

// The lines of the callers' code where the repeats part ways (evidence.call_lines).
function callLinesNote(f: Finding): HTMLElement | null {
  const lines = f.evidence.call_lines as Where[] | null | undefined;
  if (!lines || lines.length < 2) return null;
  return h("div", { class: "mono call-lines" }, `called from: ${lines.map((l) => site(l)).join(", ")}`);
}

export function findingList(ctx: Ctx, found: Finding[], open: string | null): HTMLElement {
  if (!found.length) return h("p", { class: "dim" }, "No findings in this window.");
  return h(
    "ol",
    { class: "findings" },
    found.map((f) => {
      const details = h("div", { class: "evidence" });
      const li = h(
        "li",
        { class: "finding", "data-id": f.id, "data-kind": f.kind },
        h(
          "div",
          { class: "finding-head" },
          h("span", { class: "impact", title: "time this problem costs per minute of traffic" }, `${fmtMs(f.impact_ms_per_min)} ms/min`),
          h("span", { class: "kind" }, f.kind),
          h("span", { class: `kind confidence confidence-${f.confidence ?? "unrated"}`, title: confidenceNote(f) }, `${f.confidence ?? "unrated"} confidence`),
          f.endpoint === SERVICE
            ? h("span", { class: "service-wide", title: "a finding of the whole service, not of one endpoint" }, "the whole service")
            : link(ctx.href("endpoint", { name: f.endpoint }), f.endpoint, { class: "endpoint-link" }),
        ),
        h("div", { class: "finding-title" }, f.title),
        f.callsite ? h("div", { class: "mono dim" }, `at ${site(f.callsite)} — ${f.callsite.file ?? ""}`) : null,
        templateNote(f),
        callLinesNote(f),
        h(
          "div",
          { class: "examples" },
          f.example_trace_ids.length ? "example traces: " : null,
          f.example_trace_ids.map((t) => link(ctx.href("trace", { id: t }), t.slice(0, 12), { class: "trace-link mono" })),
          " ",
          h("button", { class: "small", onclick: () => void toggle(ctx, f, details) }, "evidence"),
        ),
        details,
      );
      if (open === f.id) void toggle(ctx, f, details);
      return li;
    }),
  );
}

async function toggle(ctx: Ctx, f: Finding, box: HTMLElement): Promise<void> {
  if (box.childElementCount) {
    box.replaceChildren();
    return;
  }
  box.append(h("span", { class: "dim" }, "loading…"));
  try {
    const d = await get("/api/findings/{finding_id}", { finding_id: f.id, since: ctx.since });
    box.replaceChildren(
      ...[
      d.source_line ? h("pre", { class: "code" }, `${d.callsite?.line ?? ""} | ${d.source_line}`) : null,
      d.fingerprint ? h("div", {}, h("b", {}, "Statement: "), h("code", {}, d.fingerprint)) : null,
      d.count_per_request !== null ? h("div", {}, h("b", {}, "Per request: "), fmtNum(d.count_per_request)) : null,
      h("div", { class: "confidence-note" }, h("b", {}, "How sure: "), confidenceNote(d)),
      h(
        "table",
        { class: "grid kv" },
        h("tbody", {}, Object.entries(d.evidence).map(([k, v]) => h("tr", {}, h("th", {}, k.replace(/_/g, " ")), h("td", { class: "mono" }, typeof v === "number" ? (Number.isInteger(v) ? fmtInt(v) : fmtNum(v, Math.abs(v) < 1 ? 3 : 1)) : typeof v === "object" ? JSON.stringify(v) : String(v))))),
      ),
      h("div", {}, h("b", {}, "What to do: "), d.suggestion),
      ].filter((x): x is NonNullable<typeof x> => x !== null),
    );
  } catch (e) {
    box.replaceChildren(h("div", { class: "error" }, String(e)));
  }
}

export async function findingsPage(root: HTMLElement, ctx: Ctx): Promise<void> {
  const found = await get("/api/findings", { since: ctx.since });
  root.append(section(`Findings (${found.length}), highest impact first`, findingList(ctx, found, ctx.params.get("id"))));
}
