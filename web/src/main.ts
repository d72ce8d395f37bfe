// perfsleuth web UI: a hash router (#/page?params) over the pages; the range picker and the
// auto-refresh live in the URL too, so a link shows the same view.
import "./style.css";
import { get, token, type Fleet } from "./api";
import { h, errorBox } from "./util";
import { overviewPage } from "./pages/overview";
import { endpointPage } from "./pages/endpoint";
import { tracePage } from "./pages/trace";
import { findingsPage } from "./pages/findings";
import { sqlPage } from "./pages/sql";
import { comparePage } from "./pages/compare";
import { startupPage } from "./pages/startup";
import { loadPage } from "./pages/load";

export interface Ctx {
  params: URLSearchParams;
  since: string;
  /** The fleet filters ("" for all): the overview and endpoint pages show only their requests. */
  host: string;
  service: string;
  /** The hosts and services of the range (/api/fleet, fetched once per render for the header's
   * pickers and the overview's fleet card); null when it failed. */
  fleet: Promise<Fleet | null>;
  /** Replace some params of the current page in the URL (re-renders). */
  set(changes: Record<string, string | undefined>): void;
  /** The hash of a page with the current range and refresh kept. */
  href(page: string, params?: Record<string, string | number | undefined>): string;
}

type Page = (root: HTMLElement, ctx: Ctx) => Promise<void>;

const PAGES: Record<string, { title: string; page: Page; nav: boolean }> = {
  overview: { title: "Overview", page: overviewPage, nav: true },
  endpoint: { title: "Endpoint", page: endpointPage, nav: false },
  trace: { title: "Trace", page: tracePage, nav: false },
  findings: { title: "Findings", page: findingsPage, nav: true },
  compare: { title: "Compare", page: comparePage, nav: true },
  load: { title: "Load", page: loadPage, nav: true },
  startup: { title: "Start-up", page: startupPage, nav: true },
  sql: { title: "SQL", page: sqlPage, nav: true },
};

const RANGES = ["5m", "15m", "1h", "6h", "24h", "7d", "30d", "all"];
const REFRESH = [["0", "off"], ["5", "5 s"], ["15", "15 s"], ["30", "30 s"], ["60", "1 min"]];
const DEFAULT_SINCE = "1h";
const DEFAULT_REFRESH = "30";

function parse(): { page: string; params: URLSearchParams } {
  const raw = location.hash.replace(/^#\/?/, "");
  const [page, query] = raw.split("?", 2);
  return { page: PAGES[page] ? page : "overview", params: new URLSearchParams(query ?? "") };
}

function hashOf(page: string, params: URLSearchParams): string {
  const s = params.toString();
  return `#/${page}${s ? "?" + s : ""}`;
}

let timer: number | undefined;
let generation = 0;

async function render(): Promise<void> {
  const { page, params } = parse();
  const hash = location.hash;
  const since = params.get("since") || DEFAULT_SINCE;
  const refresh = params.get("refresh") ?? DEFAULT_REFRESH;
  const host = params.get("host") ?? "";
  const service = params.get("service") ?? "";
  const ctx: Ctx = {
    params,
    since,
    host,
    service,
    fleet: get("/api/fleet", { since }).catch(() => null),
    set(changes) {
      const p = new URLSearchParams(params);
      for (const [k, v] of Object.entries(changes)) {
        if (v === undefined || v === "") p.delete(k);
        else p.set(k, v);
      }
      location.hash = hashOf(page, p);
    },
    href(target, extra = {}) {
      const p = new URLSearchParams();
      if (params.get("since")) p.set("since", since);
      if (params.get("refresh") !== null) p.set("refresh", refresh);
      for (const k of KEPT) if (params.get(k)) p.set(k, params.get(k)!);
      for (const [k, v] of Object.entries(extra)) {
        if (v === undefined || v === "") p.delete(k);
        else p.set(k, String(v));
      }
      return hashOf(target, p);
    },
  };
  // Header: nav, range, refresh.
  const nav = document.getElementById("nav")!;
  nav.replaceChildren(
    ...Object.entries(PAGES)
      .filter(([, p]) => p.nav)
      .map(([name, p]) => h("a", { href: ctx.href(name), class: name === page ? "active" : "" }, p.title)),
  );
  const sinceSel = document.getElementById("since") as HTMLSelectElement;
  sinceSel.replaceChildren(...RANGES.map((r) => h("option", { value: r, selected: r === since }, r)));
  if (!RANGES.includes(since)) sinceSel.append(h("option", { value: since, selected: true }, since));
  sinceSel.onchange = () => ctx.set({ since: sinceSel.value });
  const refSel = document.getElementById("refresh") as HTMLSelectElement;
  refSel.replaceChildren(...REFRESH.map(([v, l]) => h("option", { value: v, selected: v === refresh }, l)));
  refSel.onchange = () => ctx.set({ refresh: refSel.value });
  const mine = ++generation;
  void fleetFilters(ctx, hash, mine);
  document.title = `perfsleuth · ${PAGES[page].title}`;

  const app = document.getElementById("app")!;
  window.clearTimeout(timer);
  const content = h("div", { class: "page", "data-page": page });
  try {
    await PAGES[page].page(content, ctx);
    if (mine !== generation) return; // a newer render took over
    // An auto-refresh keeps the reader's place (charts and hierarchies are drawn a frame
    // later); a new page starts at the top.
    const refreshing = app.dataset.hash === hash;
    const y = window.scrollY;
    app.replaceChildren(content);
    if (refreshing) requestAnimationFrame(() => requestAnimationFrame(() => window.scrollTo(0, y)));
    else window.scrollTo(0, 0);
    app.dataset.ready = page;
    app.dataset.hash = hash; // what is shown (tests wait for it)
  } catch (e) {
    if (mine !== generation) return;
    app.replaceChildren(h("div", { class: "page", "data-page": page }, errorBox(e)));
    app.dataset.ready = page;
    app.dataset.hash = hash;
  }
  status();
  const secs = Number(refresh);
  // Pages that run a query on demand (the SQL console, a comparison) are not re-run by the timer.
  if (secs > 0 && !ON_DEMAND.has(page)) timer = window.setTimeout(() => void render(), secs * 1000);
}

const ON_DEMAND = new Set(["sql", "compare"]);
// Params every link keeps, like the range: the fleet filters.
const KEPT = ["host", "service"];

/** The host and service pickers: shown when the store holds more than one of either (or one is
 * chosen), their choices the hosts and services with requests in the range. The header's
 * data-fleet is the hash they were filled for (tests wait for it). */
async function fleetFilters(ctx: Ctx, hash: string, mine: number): Promise<void> {
  const f = await ctx.fleet; // null when it failed: the pickers as if empty
  if (mine !== generation) return; // a newer render fills them
  const hosts = f?.hosts ?? [];
  const services = f?.services ?? [];
  const pick = (id: "host" | "service", values: string[], current: string, all: string) => {
    const sel = document.getElementById(id) as HTMLSelectElement;
    const label = document.getElementById(`${id}-filter`)!;
    // "" (requests that carry no host, e.g. OTLP without host.name) is not a choice here:
    // the empty value means all.
    const named = values.filter((v) => v !== "");
    const shown = current && !named.includes(current) ? [...named, current] : named;
    sel.replaceChildren(
      h("option", { value: "", selected: !current }, all),
      ...shown.map((v) => h("option", { value: v, selected: v === current }, v)),
    );
    sel.onchange = () => ctx.set({ [id]: sel.value });
    label.hidden = values.length < 2 && !current;
  };
  pick("host", hosts, ctx.host, "all hosts");
  pick("service", services, ctx.service, "all services");
  document.getElementById("top")!.dataset.fleet = hash;
}

async function status(): Promise<void> {
  const el = document.getElementById("status")!;
  try {
    const s = await get("/api/status");
    const at = s.ingest_every_s <= 0 ? "never (read-only)" : s.ingest.at ? new Date(s.ingest.at * 1000).toISOString().slice(11, 19) + "Z" : "-";
    el.textContent = s.ingest.error ? `ingest failed: ${s.ingest.error}` : `latest request ${s.last ? s.last.slice(0, 19).replace("T", " ") + "Z" : "-"} · ingested ${at}`;
  } catch (e) {
    el.textContent = e instanceof Error ? e.message : String(e);
  }
}

token(); // remember ?token= for the session
window.addEventListener("hashchange", () => void render());
void render();
