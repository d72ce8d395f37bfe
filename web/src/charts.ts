// uPlot wrappers: time-series charts sized to their container.
import uPlot from "uplot";
import "uplot/dist/uPlot.min.css";
import { fmtMs } from "./format";
import { h } from "./util";

export const PALETTE = ["#1f77b4", "#d62728", "#2ca02c", "#ff7f0e", "#9467bd", "#8c564b", "#e377c2", "#17becf", "#7f7f7f", "#bcbd22"];

export interface Line {
  label: string;
  values: (number | null)[];
  color?: string;
  dash?: number[];
  unit?: string;
  bars?: boolean;
  scale?: string;
}

const charts = new Set<uPlot>();
window.addEventListener("resize", () => {
  for (const c of charts) {
    const parent = c.root.parentElement;
    if (parent && parent.isConnected) c.setSize({ width: parent.clientWidth, height: c.height });
    else charts.delete(c);
  }
});

export function timeChart(title: string, x: number[], lines: Line[], opts: { height?: number; yLabel?: string; y2Label?: string } = {}): HTMLElement {
  const box = h("div", { class: "chart" });
  const holder = h("div", { class: "chart-card" }, h("div", { class: "chart-title" }, title), box);
  const series: uPlot.Series[] = [{}];
  const hasY2 = lines.some((l) => l.scale === "y2");
  for (const [i, l] of lines.entries()) {
    series.push({
      label: l.label,
      stroke: l.color ?? PALETTE[i % PALETTE.length],
      width: 1.5,
      dash: l.dash,
      spanGaps: false,
      scale: l.scale ?? "y",
      fill: l.bars ? (l.color ?? PALETTE[i % PALETTE.length]) + "55" : undefined,
      paths: l.bars ? uPlot.paths.bars!({ size: [0.8, 40] }) : undefined,
      // milliseconds by the one rule (format.ts); counts with one decimal under 100
      value: (_u, v) =>
        l.unit === " ms" ? fmtMs(v) + " ms" : (v === null || v === undefined ? "-" : v >= 100 ? Math.round(v).toLocaleString("en-US") : v.toFixed(1)) + (l.unit ?? ""),
    });
  }
  const axes: uPlot.Axis[] = [{}, { label: opts.yLabel, size: 72 }];
  if (hasY2) axes.push({ scale: "y2", side: 1, label: opts.y2Label, grid: { show: false }, size: 60 });
  const make = () => {
    const width = Math.max(300, box.clientWidth || holder.clientWidth || 600);
    const u = new uPlot(
      {
        width,
        height: opts.height ?? 220,
        series,
        axes,
        scales: { x: { time: true }, y: { range: (_u, _min, max) => [0, max > 0 ? max * 1.05 : 1] }, y2: { range: (_u, _min, max) => [0, max > 0 ? max * 1.05 : 1] } },
        legend: { live: true },
        cursor: { drag: { x: false, y: false } },
      },
      [x, ...lines.map((l) => l.values)] as uPlot.AlignedData,
      box,
    );
    charts.add(u);
  };
  // Laid out first, so the chart takes the width it is given.
  requestAnimationFrame(make);
  return holder;
}

/** A histogram over log-spaced bins, drawn as plain bars (HTML). */
export function histogram(bins: { lo_ms: number; hi_ms: number; count: number }[], fmt: (v: number) => string): HTMLElement {
  const max = Math.max(1, ...bins.map((b) => b.count));
  return h(
    "div",
    { class: "hist" },
    bins.map((b) =>
      h(
        "div",
        { class: "hist-col", title: `${fmt(b.lo_ms)}-${fmt(b.hi_ms)} ms: ${b.count.toLocaleString("en-US")} requests` },
        h("div", { class: "hist-bar", style: { height: ((b.count / max) * 100).toFixed(1) + "%" } }),
        h("div", { class: "hist-lbl" }, fmt(b.lo_ms)),
      ),
    ),
  );
}
