// The API client: every call carries the token when the page was opened with ?token=.
const TOKEN_KEY = "perfsleuth.token";

export function token(): string | null {
  const search = new URLSearchParams(location.search);
  const fromUrl = search.get("token");
  if (fromUrl) {
    sessionStorage.setItem(TOKEN_KEY, fromUrl);
    // Out of the address bar (and so out of links copied from it), kept for this tab.
    search.delete("token");
    const rest = search.toString();
    history.replaceState(null, "", location.pathname + (rest ? "?" + rest : "") + location.hash);
  }
  return sessionStorage.getItem(TOKEN_KEY);
}

export class ApiError extends Error {
  constructor(public status: number, message: string) {
    super(message);
  }
}

/** Plain text from the API (e.g. a curl command). */
export async function apiText(path: string): Promise<string> {
  const headers: Record<string, string> = {};
  const t = token();
  if (t) headers["Authorization"] = `Bearer ${t}`;
  const res = await fetch(`api/${path}`, { headers });
  if (!res.ok) throw new ApiError(res.status, `HTTP ${res.status}`);
  return res.text();
}

export async function api<T>(path: string, params: Record<string, string | number | undefined> = {}, body?: unknown): Promise<T> {
  const q = new URLSearchParams();
  for (const [k, v] of Object.entries(params)) if (v !== undefined && v !== "") q.set(k, String(v));
  const headers: Record<string, string> = {};
  const t = token();
  if (t) headers["Authorization"] = `Bearer ${t}`;
  if (body !== undefined) headers["Content-Type"] = "application/json";
  const url = `api/${path}${q.toString() ? "?" + q : ""}`;
  const res = await fetch(url, { method: body === undefined ? "GET" : "POST", headers, body: body === undefined ? undefined : JSON.stringify(body) });
  let data: unknown = null;
  try {
    data = await res.json();
  } catch {
    throw new ApiError(res.status, `the server answered ${res.status} without JSON`);
  }
  if (!res.ok) throw new ApiError(res.status, (data as { error?: string })?.error ?? `HTTP ${res.status}`);
  return data as T;
}

type Params = Record<string, string | number | undefined>;

/** GET an API path named as in the OpenAPI schema ("/api/traces/{trace_id}"), its reply typed
 * by the schema: {name} parts are filled from ``params``, the other params are the query. */
export function get<P extends keyof GetReplies>(path: P, params: Params = {}): Promise<GetReplies[P]> {
  const used = new Set<string>();
  const filled = path.replace(/\{(\w+)\}/g, (_, k: string) => {
    used.add(k);
    return encodeURIComponent(String(params[k] ?? ""));
  });
  const query: Params = {};
  for (const [k, v] of Object.entries(params)) if (!used.has(k)) query[k] = v;
  return api<GetReplies[P]>(filled.slice("/api/".length), query);
}

// The replies' types are generated from the API's OpenAPI schema (scripts/openapi_ts.py).
export type {
  ApiErrorBody,
  BlockerEvent,
  Call,
  CallTreeNode,
  CompareResult,
  CompareRow,
  CompareValue,
  EndpointDetail,
  Finding,
  FindingBrief,
  FindingDetail,
  Fleet,
  FleetSource,
  FleetToken,
  Frame,
  GetReplies,
  Histogram,
  LoadRunBrief,
  Moved,
  Overview,
  Profile,
  ProfileNode,
  Replay,
  SideStats,
  SqlResult,
  StartupRunBrief,
  Status,
  TimeWindow,
  TopRow,
  Trace,
  TraceRow,
  WhoRow,
} from "./api.gen";
import type { GetReplies } from "./api.gen";
