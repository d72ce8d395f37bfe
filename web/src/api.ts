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

export interface TopRow {
  endpoint: string;
  count: number;
  rate_per_min: number;
  p50_ms: number | null;
  p95_ms: number | null;
  p99_ms: number | null;
  max_ms: number | null;
  error_rate: number;
  db_calls_per_request: number;
  http_calls_per_request: number;
  cache_calls_per_request: number;
  db_share: number;
  http_share: number;
  cache_share: number;
  gc_share: number;
  total_ms: number;
  time_share: number;
}

export interface Win { since: string; start: number; end: number; step: number }

export interface Overview {
  window: Win;
  totals: { requests: number; endpoints: number; errors: number };
  endpoints: TopRow[];
  p95: { x: number[]; series: { endpoint: string; values: (number | null)[] }[] };
  throughput: { x: number[]; requests: number[]; errors: number[] };
  slow: {
    x: number[];
    thresholds: number[];
    now: Record<string, number[]>;
    week_ago: Record<string, number[]>;
    totals: { threshold_ms: number; now: number; week_ago: number }[];
  };
}

export interface TraceRow {
  trace_id: string;
  ts: string;
  endpoint: string;
  method: string;
  path: string;
  status: number | null;
  duration_ms: number | null;
  db_calls: number;
  db_ms: number;
  http_calls: number;
  http_ms: number;
  cache_calls: number;
  cache_ms: number;
  user: string | null;
  tenant: string | null;
}

export interface Frame { file: string | null; line: number | null; function: string | null; app?: boolean | null }

export interface EndpointDetail {
  endpoint: string;
  window: Win;
  summary: TopRow | null;
  percentiles: { x: number[]; p50: (number | null)[]; p95: (number | null)[]; p99: (number | null)[]; count: (number | null)[] };
  histogram: { lo_ms: number; hi_ms: number; count: number }[];
  fingerprints: { fingerprint_id: string; kind: string; statement: string | null; calls: number; requests: number; total_ms: number; p95_ms: number | null; avg_rows: number | null; calls_per_request: number | null }[];
  hosts: { host: string; calls: number; total_ms: number; p95_ms: number | null; errors: number }[];
  slowest: TraceRow[];
  users: { name: string; count: number; total_ms: number; p95_ms: number | null }[];
  tenants: { name: string; count: number; total_ms: number; p95_ms: number | null }[];
}

export interface TreeNode { name: string; file?: string | null; line?: number | null; function?: string | null; calls?: number; ms?: number; value?: number; self?: number; children: TreeNode[] }

export interface ProfileData { endpoint: string; requests: number; samples: number; states: Record<string, number>; top: { function: string; file: string; line: number; self: number; total: number; self_share: number; total_share: number }[]; tree: TreeNode }

export interface Finding {
  id: string;
  kind: string;
  endpoint: string;
  title: string;
  impact_ms_per_min: number;
  callsite: Frame | null;
  fingerprint: string | null;
  count_per_request: number | null;
  example_trace_ids: string[];
  first_seen: string | null;
  last_seen: string | null;
  suggestion: string;
  evidence: Record<string, unknown>;
  source_line?: string | null;
}

export interface Call {
  seq: number;
  kind: string;
  system: string | null;
  offset_ms: number | null;
  duration_ms: number | null;
  fingerprint: string | null;
  op: string | null;
  rows: number | null;
  bytes: number | null;
  host: string | null;
  status: number | null;
  hit: boolean | null;
  wait_ms: number | null;
  error: string | null;
  unfinished: boolean | null;
  site: Frame | null;
  stack: Frame[];
}

export interface Trace extends Record<string, unknown> {
  trace_id: string;
  ts: string;
  endpoint: string;
  method: string;
  path: string;
  status: number | null;
  duration_ms: number | null;
  cpu_ms: number | null;
  user: string | null;
  tenant: string | null;
  service: string;
  attributes: Record<string, unknown>;
  tags: Record<string, string>;
  calls: Call[];
  samples: number;
  blockers: number;
  stack_samples: { offset_ms: number; state: string; stack: Frame[] }[];
  profile: TreeNode | null;
  replay: { reason: string | null; method: string; url: string; body_size: number | null; body_truncated: boolean | null; redacted: string[]; note: string | null; curl: string; complete: boolean } | null;
  blocker_events: { ts: string; duration_ms: number; delayed: number; last_call: string | null; stack: Frame[] }[];
}

export interface SqlResult { columns: string[]; rows: unknown[][]; truncated: boolean; truncated_by?: "rows" | "bytes" | null; limit: number; elapsed_ms: number }
