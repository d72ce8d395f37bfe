// Numbers as every page shows them: the rule written down in src/perfsleuth/analysis/text.py
// (finding titles and the CLI use the same; tests/test_formats.py runs both on the same values).
// Milliseconds: under 1 two decimals (0.35), under 10 one (4.2), else whole with thousands
// separators (63, 1,250). A share 0..1: exactly 0 is "0%", under 10 % one decimal (4.2%), else
// whole (63%). Rounding half away from zero; no value (null, NaN, infinite) is "-".

const whole = new Intl.NumberFormat("en-US", { maximumFractionDigits: 0 });

function missing(v: number | null | undefined): v is null | undefined {
  return v === null || v === undefined || !Number.isFinite(v);
}

/** Milliseconds without the unit: 0.35, 4.2, 63, 1,250. */
export function fmtMs(v: number | null | undefined): string {
  if (missing(v)) return "-";
  const a = Math.abs(v);
  return a < 1 ? v.toFixed(2) : a < 10 ? v.toFixed(1) : whole.format(v);
}

/** A share 0..1 as a percentage: 0%, 4.2%, 63%. */
export function fmtPct(v: number | null | undefined): string {
  if (missing(v)) return "-";
  const p = v * 100;
  if (p === 0) return "0%";
  return (Math.abs(p) < 10 ? p.toFixed(1) : whole.format(p)) + "%";
}

/** A count: whole, with thousands separators. */
export function fmtInt(v: number | null | undefined): string {
  return missing(v) ? "-" : whole.format(v);
}
