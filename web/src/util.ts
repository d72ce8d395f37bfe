// DOM helpers shared by the pages; the number formats are in format.ts.
import { fmtMs, fmtPct } from "./format";

type Child = Node | string | number | null | undefined | false;

export function h<K extends keyof HTMLElementTagNameMap>(tag: K, attrs: Record<string, unknown> = {}, ...children: (Child | Child[])[]): HTMLElementTagNameMap[K] {
  const el = document.createElement(tag);
  for (const [k, v] of Object.entries(attrs)) {
    if (v === undefined || v === null || v === false) continue;
    if (k.startsWith("on") && typeof v === "function") el.addEventListener(k.slice(2), v as EventListener);
    else if (k === "class") el.className = String(v);
    else if (k === "style" && typeof v === "object") Object.assign(el.style, v);
    else el.setAttribute(k, String(v));
  }
  for (const c of children.flat()) {
    if (c === null || c === undefined || c === false) continue;
    el.append(c instanceof Node ? c : document.createTextNode(String(c)));
  }
  return el;
}

/** Short axis labels for milliseconds: fmtMs under a second (0.35, 4.2, 63, 250), then
 * seconds (1.6s, 16s). */
export function fmtMsShort(v: number): string {
  if (v < 1000) return fmtMs(v);
  return (v < 10000 ? (v / 1000).toFixed(1) : String(Math.round(v / 1000))) + "s";
}

export function fmtNum(v: number | null | undefined, digits = 1): string {
  if (v === null || v === undefined || !isFinite(v)) return "-";
  return v.toLocaleString("en-US", { maximumFractionDigits: digits, minimumFractionDigits: digits });
}

export function fmtBytes(v: number | null | undefined): string {
  if (v === null || v === undefined) return "-";
  const units = ["B", "KB", "MB", "GB"];
  let i = 0;
  while (v >= 1024 && i < units.length - 1) {
    v /= 1024;
    i++;
  }
  return `${i ? v.toFixed(1) : v} ${units[i]}`;
}

export function fmtTime(iso: string | null | undefined): string {
  if (!iso) return "-";
  const d = new Date(iso);
  return d.toISOString().replace("T", " ").slice(0, 19) + "Z";
}

export function basename(p: string | null | undefined): string {
  if (!p) return "?";
  const parts = p.split("/");
  return parts[parts.length - 1];
}

export function site(f: { file?: string | null; line?: number | null; function?: string | null } | null | undefined): string {
  if (!f) return "";
  return `${f.function ?? "?"} (${basename(f.file)}:${f.line ?? "?"})`;
}

export function link(hash: string, text: Child, attrs: Record<string, unknown> = {}): HTMLAnchorElement {
  return h("a", { href: hash, ...attrs }, text);
}

export function routeHash(page: string, params: Record<string, string | number | undefined>): string {
  const q = new URLSearchParams();
  for (const [k, v] of Object.entries(params)) if (v !== undefined && v !== "") q.set(k, String(v));
  const s = q.toString();
  return `#/${page}${s ? "?" + s : ""}`;
}

export function section(title: string, ...body: Child[]): HTMLElement {
  return h("section", { class: "card" }, h("h2", {}, title), ...body);
}

export function errorBox(e: unknown): HTMLElement {
  const msg = e instanceof Error ? e.message : String(e);
  return h("div", { class: "error" }, msg);
}

export interface Col<T> {
  key: string;
  label: string;
  num?: boolean;
  value?: (r: T) => number | string | null | undefined;
  render?: (r: T) => Child;
  title?: string;
}

/** A table; sortable by clicking a header when ``onSort`` is given. */
export function table<T>(cols: Col<T>[], rows: T[], opts: { sort?: string; desc?: boolean; onSort?: (key: string) => void; cls?: string; rowAttrs?: (r: T) => Record<string, unknown> } = {}): HTMLTableElement {
  const head = h(
    "tr",
    {},
    cols.map((c) =>
      h(
        "th",
        { class: (c.num ? "num" : "") + (opts.onSort ? " sortable" : ""), title: c.title, "data-col": c.key, onclick: opts.onSort ? () => opts.onSort!(c.key) : undefined },
        c.label,
        opts.sort === c.key ? (opts.desc ? " ▼" : " ▲") : "",
      ),
    ),
  );
  const body = rows.map((r) =>
    h(
      "tr",
      opts.rowAttrs ? opts.rowAttrs(r) : {},
      cols.map((c) => {
        const raw = c.value ? c.value(r) : (r as Record<string, unknown>)[c.key];
        const content = c.render ? c.render(r) : raw === null || raw === undefined ? "-" : String(raw);
        return h("td", { class: c.num ? "num" : "", "data-col": c.key, "data-value": typeof raw === "number" || typeof raw === "string" ? raw : undefined }, content);
      }),
    ),
  );
  return h("table", { class: opts.cls ?? "grid" }, h("thead", {}, head), h("tbody", {}, body));
}

export function bar(share: number): HTMLElement {
  const pct = Math.max(0, Math.min(1, share)) * 100;
  return h("span", { class: "bar" }, h("span", { class: "fill", style: { width: pct.toFixed(1) + "%" } }), h("span", { class: "lbl" }, fmtPct(share)));
}
