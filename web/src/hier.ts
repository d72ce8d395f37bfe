// Hierarchies with d3: the call-site treemap and the flame graph (icicle).
import { hierarchy, treemap, treemapSquarify, partition, type HierarchyRectangularNode } from "d3-hierarchy";
import type { CallTreeNode, ProfileNode } from "./api";
import { fmtMs, fmtInt, fmtPct } from "./format";

const SVG = "http://www.w3.org/2000/svg";

function svgEl(tag: string, attrs: Record<string, string | number>): SVGElement {
  const el = document.createElementNS(SVG, tag);
  for (const [k, v] of Object.entries(attrs)) el.setAttribute(k, String(v));
  return el;
}

function hue(name: string): string {
  let x = 0;
  for (let i = 0; i < name.length; i++) x = (x * 31 + name.charCodeAt(i)) >>> 0;
  return `hsl(${x % 360}, 55%, ${62 + (x % 15)}%)`;
}

/** Own value of a call-tree node: its time minus its children's (calls that end there). */
function own(n: CallTreeNode): number {
  const kids = (n.children ?? []).reduce((s, c) => s + (c.ms ?? 0), 0);
  return Math.max(0, (n.ms ?? 0) - kids);
}

export function treemapView(root: CallTreeNode, width: number, height = 420, onPick?: (n: CallTreeNode) => void): SVGElement {
  const svg = svgEl("svg", { width, height, class: "treemap", viewBox: `0 0 ${width} ${height}` });
  const h = hierarchy(root, (d) => d.children).sum((d) => own(d));
  const layout = treemap<CallTreeNode>().size([width, height]).paddingOuter(2).paddingTop(16).paddingInner(1).tile(treemapSquarify).round(true);
  const laid = layout(h);
  const total = root.ms || 1;
  for (const n of laid.descendants()) {
    const w = n.x1 - n.x0;
    const ht = n.y1 - n.y0;
    if (w < 2 || ht < 2) continue;
    const g = svgEl("g", { class: "treemap-node", transform: `translate(${n.x0},${n.y0})`, "data-name": n.data.name, "data-depth": n.depth });
    const rect = svgEl("rect", { width: w, height: ht, fill: n.depth === 0 ? "#f4f4f4" : hue(n.data.function ?? n.data.name), stroke: "#fff" });
    const title = svgEl("title", {});
    title.textContent = `${n.data.name}\n${n.data.file ?? ""}\n${fmtInt(n.data.calls)} calls, ${fmtMs(n.data.ms)} ms (${fmtPct((n.data.ms ?? 0) / total)})`;
    g.append(rect, title);
    if (w > 40 && ht > 12) {
      const t = svgEl("text", { x: 3, y: 12, class: "tm-label" });
      const label = `${n.data.name} · ${fmtInt(n.data.calls)} calls · ${fmtMs(n.data.ms)} ms`;
      t.textContent = label.length * 6.2 > w ? label.slice(0, Math.max(3, Math.floor(w / 6.2) - 1)) + "…" : label;
      g.append(t);
    }
    if (onPick) g.addEventListener("click", (e) => {
      e.stopPropagation();
      onPick(n.data);
    });
    svg.append(g);
  }
  return svg;
}

export function flameGraph(root: ProfileNode, width: number, onPick?: (n: ProfileNode) => void): SVGElement {
  const row = 18;
  const h = hierarchy(root, (d) => d.children).sum((d) => d.self ?? 0);
  const depth = h.height + 1;
  const height = depth * row;
  const laid: HierarchyRectangularNode<ProfileNode> = partition<ProfileNode>().size([width, height]).padding(0)(h);
  const svg = svgEl("svg", { width, height, class: "flame", viewBox: `0 0 ${width} ${height}` });
  const total = h.value || 1;
  for (const n of laid.descendants()) {
    const w = n.x1 - n.x0;
    if (w < 0.5) continue;
    const g = svgEl("g", { class: "flame-frame", transform: `translate(${n.x0},${n.depth * row})`, "data-name": n.data.name });
    const rect = svgEl("rect", { width: Math.max(0.5, w - 0.5), height: row - 1, fill: n.depth === 0 ? "#ccc" : hue(n.data.file ?? n.data.name), rx: 1 });
    const title = svgEl("title", {});
    title.textContent = `${n.data.name}\n${n.data.file ?? ""}\n${fmtInt(n.value)} samples (${fmtPct((n.value ?? 0) / total)}), ${fmtInt(n.data.self)} self`;
    g.append(rect, title);
    if (w > 30) {
      const t = svgEl("text", { x: 3, y: 13, class: "fl-label" });
      const label = n.data.name;
      t.textContent = label.length * 6.2 > w ? label.slice(0, Math.max(2, Math.floor(w / 6.2) - 1)) + "…" : label;
      g.append(t);
    }
    if (onPick) g.addEventListener("click", () => onPick(n.data));
    svg.append(g);
  }
  return svg;
}
