import { api, type SqlResult } from "../api";
import type { Ctx } from "../main";
import { fmtInt } from "../format";
import { h, section } from "../util";

const EXAMPLE = "SELECT endpoint, count(*) AS requests, round(quantile_cont(duration_ms, 0.95), 1) AS p95_ms\nFROM requests GROUP BY 1 ORDER BY 2 DESC LIMIT 20";

export async function sqlPage(root: HTMLElement, ctx: Ctx): Promise<void> {
  const q = ctx.params.get("q") || EXAMPLE;
  const area = h("textarea", { id: "sql", rows: 6, spellcheck: "false" }, q) as HTMLTextAreaElement;
  const out = h("div", { id: "sql-result" });
  const run = () => {
    if (area.value === ctx.params.get("q")) void exec(area.value, out);
    else ctx.set({ q: area.value });
  };
  area.addEventListener("keydown", (e) => {
    if (e.key === "Enter" && (e.ctrlKey || e.metaKey)) run();
  });
  root.append(
    section(
      "SQL console (read-only; tables: requests, calls, attributes, samples, blockers, gc_pauses, captures, fingerprints, locations, stacks)",
      area,
      h("div", { class: "row" }, h("button", { id: "run-sql", onclick: run }, "Run (Ctrl+Enter)"), h("span", { class: "dim" }, "one SELECT at a time; at most 10,000 rows, 10 s")),
      out,
    ),
  );
  if (ctx.params.get("q")) await exec(q, out);
}

async function exec(q: string, out: HTMLElement): Promise<void> {
  out.replaceChildren(h("span", { class: "dim" }, "running…"));
  try {
    const r = await api<SqlResult>("sql", {}, { query: q, limit: 1000 });
    out.replaceChildren(
      h("div", { class: "dim" }, `${fmtInt(r.rows.length)} rows${r.truncated ? (r.truncated_by === "bytes" ? " (stopped at the reply's size cap)" : ` (stopped at ${fmtInt(r.limit)})`) : ""} in ${r.elapsed_ms.toFixed(1)} ms`),
      h(
        "div",
        { class: "scroll" },
        h(
          "table",
          { class: "grid" },
          h("thead", {}, h("tr", {}, r.columns.map((c, i) => h("th", { class: typeof r.rows[0]?.[i] === "number" ? "num" : "" }, c)))),
          h("tbody", {}, r.rows.map((row) => h("tr", {}, row.map((v) => h("td", { class: typeof v === "number" ? "num" : "" }, v === null ? "NULL" : typeof v === "object" ? JSON.stringify(v) : String(v)))))),
        ),
      ),
    );
  } catch (e) {
    out.replaceChildren(h("div", { class: "error" }, e instanceof Error ? e.message : String(e)));
  }
}
