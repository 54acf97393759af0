// A small time-series chart in plain SVG (no library): one polyline per series over a shared y scale.

const SVG = 'http://www.w3.org/2000/svg';

function svg(tag, attrs) {
  const node = document.createElementNS(SVG, tag);
  for (const [k, v] of Object.entries(attrs)) node.setAttribute(k, String(v));
  return node;
}

export class LineChart {
  // series: [{key, className}]; capacity: points kept per series (older ones scroll out)
  constructor(svgNode, series, capacity = 60) {
    this.node = svgNode;
    this.series = series;
    this.capacity = capacity;
    this.points = [];  // [{key: value, ...}] oldest first
    const box = svgNode.viewBox.baseVal;
    this.width = box.width || 400;
    this.height = box.height || 120;
  }

  push(values) {
    this.points.push(values);
    if (this.points.length > this.capacity) this.points.shift();
    this.draw();
  }

  draw() {
    const { width: w, height: h } = this;
    const pad = 14;  // room for the max label at the top
    const max = Math.max(1, ...this.points.flatMap((p) => this.series.map((s) => p[s.key] || 0)));
    const step = w / Math.max(1, this.capacity - 1);
    const offset = this.capacity - this.points.length;  // new points enter on the right
    const children = [
      svg('line', { x1: 0, y1: h - 0.5, x2: w, y2: h - 0.5, class: 'axis' }),
      svg('line', { x1: 0, y1: pad, x2: w, y2: pad, class: 'grid' }),
    ];
    const label = svg('text', { x: 2, y: pad - 3, class: 'chart-label' });
    label.textContent = `${max >= 100 ? Math.round(max) : max.toFixed(1)} tok/s`;
    children.push(label);
    for (const s of this.series) {
      const coords = this.points.map((p, i) => {
        const x = (offset + i) * step;
        const y = h - ((p[s.key] || 0) / max) * (h - pad);
        return `${x.toFixed(1)},${y.toFixed(1)}`;
      });
      if (coords.length) children.push(svg('polyline', { points: coords.join(' '), class: s.className, 'data-series': s.key }));
    }
    this.node.replaceChildren(...children);
  }
}
