"""PNG plots without dependencies: a small RGB rasteriser (:class:`Canvas`, zlib only) and grids of
line panels (:func:`write_line_panels`: matplotlib when importable, else the rasteriser).

Used by ``gdngen bench`` (:func:`gdngen.bench.write_plot`), ``benchmarks/chunk_size_study.py`` and
``benchmarks/stress_gpu.py --plot``.
"""
from __future__ import annotations

import struct
import sys
import zlib
from dataclasses import dataclass
from pathlib import Path
from typing import Optional

# =============================================================================================
# PNG: a minimal line-plot rasteriser (zlib only)
# =============================================================================================

# 3x5 glyphs, rows top to bottom; letters render in capitals.
_GLYPHS = {
    "a": "010101111101101", "b": "110101110101110", "c": "011100100100011", "d": "110101101101110",
    "e": "111100110100111", "f": "111100110100100", "g": "011100101101011", "h": "101101111101101",
    "i": "111010010010111", "j": "001001001101010", "k": "101101110101101", "l": "100100100100111",
    "m": "101111111101101", "n": "110101101101101", "o": "010101101101010", "p": "110101110100100",
    "q": "010101101110011", "r": "110101110101101", "s": "011100010001110", "t": "111010010010010",
    "u": "101101101101111", "v": "101101101101010", "w": "101101111111101", "x": "101101010101101",
    "y": "101101010010010", "z": "111001010100111",
    "0": "111101101101111", "1": "010110010010111", "2": "110001010100111", "3": "110001010001110",
    "4": "101101111001001", "5": "111100110001110", "6": "011100111101111", "7": "111001010010010",
    "8": "111101111101111", "9": "111101111001110",
    ".": "000000000000010", ",": "000000000010100", "+": "000010111010000", "-": "000000111000000",
    "/": "001001010100100", "(": "010100100100010", ")": "010001001001010", "=": "000111000111000",
    ":": "000010000010000", "_": "000000000000111", " ": "000000000000000", "^": "010101000000000",
    "*": "000101010101000",
}
_PALETTE = [(31, 119, 180), (214, 39, 40), (44, 160, 44), (148, 103, 189), (255, 127, 14), (23, 190, 207),
            (140, 86, 75), (127, 127, 127)]


class Canvas:
    """An RGB pixel buffer with lines, rectangles and 3x5 bitmap text."""

    def __init__(self, width: int, height: int):
        self.width, self.height = width, height
        self.pixels = bytearray(b"\xff" * (width * height * 3))

    def dot(self, x: int, y: int, colour) -> None:
        if 0 <= x < self.width and 0 <= y < self.height:
            i = 3 * (y * self.width + x)
            self.pixels[i:i + 3] = bytes(colour)

    def rect(self, x0: int, y0: int, x1: int, y1: int, colour) -> None:
        for y in range(max(y0, 0), min(y1, self.height - 1) + 1):
            for x in range(max(x0, 0), min(x1, self.width - 1) + 1):
                self.dot(x, y, colour)

    def line(self, x0: int, y0: int, x1: int, y1: int, colour, thick: int = 1) -> None:
        """Bresenham, ``thick`` pixels wide."""
        dx, dy = abs(x1 - x0), -abs(y1 - y0)
        sx, sy = (1 if x0 < x1 else -1), (1 if y0 < y1 else -1)
        err = dx + dy
        while True:
            self.rect(x0, y0, x0 + thick - 1, y0 + thick - 1, colour)
            if x0 == x1 and y0 == y1:
                return
            e2 = 2 * err
            if e2 >= dy:
                err += dy
                x0 += sx
            if e2 <= dx:
                err += dx
                y0 += sy

    def dashed(self, x0: int, y0: int, x1: int, y1: int, colour, thick: int = 2, dash: int = 8,
               gap: int = 6) -> None:
        """A dashed line: ``dash`` pixels drawn, ``gap`` left out, along the segment."""
        import math
        length = math.hypot(x1 - x0, y1 - y0)
        s = 0.0
        while s < length:
            e = min(s + dash, length)
            self.line(round(x0 + (x1 - x0) * s / length), round(y0 + (y1 - y0) * s / length),
                      round(x0 + (x1 - x0) * e / length), round(y0 + (y1 - y0) * e / length), colour, thick)
            s += dash + gap

    def text(self, x: int, y: int, text: str, colour=(0, 0, 0), scale: int = 2) -> int:
        """Draw ``text`` with its top-left at (x, y); returns the x after it."""
        for ch in text.lower():
            glyph = _GLYPHS.get(ch, _GLYPHS[" "])
            for i, bit in enumerate(glyph):
                if bit == "1":
                    gx, gy = x + (i % 3) * scale, y + (i // 3) * scale
                    self.rect(gx, gy, gx + scale - 1, gy + scale - 1, colour)
            x += 4 * scale
        return x

    @staticmethod
    def text_width(text: str, scale: int = 2) -> int:
        return 4 * scale * len(text)

    def png(self) -> bytes:
        def chunk(kind: bytes, data: bytes) -> bytes:
            return struct.pack(">I", len(data)) + kind + data + struct.pack(">I", zlib.crc32(kind + data) & 0xFFFFFFFF)

        stride = self.width * 3
        raw = b"".join(b"\x00" + bytes(self.pixels[y * stride:(y + 1) * stride]) for y in range(self.height))
        header = struct.pack(">IIBBBBB", self.width, self.height, 8, 2, 0, 0, 0)   # 8-bit RGB
        return (b"\x89PNG\r\n\x1a\n" + chunk(b"IHDR", header) + chunk(b"IDAT", zlib.compress(raw, 6))
                + chunk(b"IEND", b""))


def _si(value: float) -> str:
    for unit, size in (("g", 1e9), ("m", 1e6), ("k", 1e3)):
        if value >= size:
            return f"{value / size:.3g}{unit}"
    return f"{value:.3g}"


def _pow2(t: int) -> str:
    """T axis labels in binary units: 2048 -> 2k, 1048576 -> 1m."""
    for unit, size in (("m", 2 ** 20), ("k", 2 ** 10)):
        if t >= size:
            return f"{t / size:g}{unit}"
    return str(t)


def _nice_step(span: float, ticks: int = 5) -> float:
    import math
    raw = span / ticks
    mag = 10 ** math.floor(math.log10(raw))
    return next(m * mag for m in (1, 2, 2.5, 5, 10) if m * mag >= raw)


# =============================================================================================
# Line panels: a grid of small line plots (matplotlib when importable, else the rasteriser above)
# =============================================================================================

@dataclass
class Series:
    """One line of a :class:`Panel`: (x, y) points, joined in x order when ``join``."""
    label: str
    points: list
    colour: tuple = _PALETTE[0]
    dashed: bool = False
    join: bool = True


@dataclass
class Panel:
    """A line plot: ``xlog2`` puts x on a log2 axis (ticks at powers of two, labelled 1k, 1m),
    ``ylog`` puts y on a log10 axis (ticks at decades); ``xticks`` overrides the x ticks."""
    title: str
    series: list
    xlabel: str = ""
    xlog2: bool = False
    ylog: bool = False
    xticks: Optional[list] = None


def _tick_label(value: float, log2: bool) -> str:
    if log2 and value >= 1 and float(value).is_integer():
        return _pow2(int(value))
    return _si(value) if value >= 0 else "-" + _si(-value)


def write_line_panels(panels: list[Panel], path: Path, *, columns: Optional[int] = None, title: str = "") -> Path:
    """A PNG of ``panels`` (``columns`` per row, default all in one row): matplotlib when importable,
    else :func:`draw_line_panels`.  Panels without points are left out; none at all is a ValueError."""
    panels = [p for p in panels if any(s.points for s in p.series)]
    if not panels:
        raise ValueError("line panels: no points to plot")
    try:
        import matplotlib
        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        print("plot: matplotlib not importable, drawing with gdngen.plot's built-in rasteriser", file=sys.stderr)
        return draw_line_panels(panels, path, columns=columns, title=title)
    columns = columns or len(panels)
    rows = -(-len(panels) // columns)
    fig, axes = plt.subplots(rows, columns, figsize=(5.5 * columns, 4.2 * rows), squeeze=False)
    for ax, panel in zip(axes.flat, panels):
        for s in panel.series:
            pts = sorted(s.points) if s.join else list(s.points)
            ax.plot([p[0] for p in pts], [p[1] for p in pts], marker="o", markersize=4,
                    linestyle=("--" if s.dashed else "-") if s.join else "none",
                    color=tuple(c / 255 for c in s.colour), label=s.label)
        if panel.xlog2:
            ax.set_xscale("log", base=2)
            ax.xaxis.set_major_formatter(plt.FuncFormatter(lambda v, _: _tick_label(v, True)))
        if panel.xticks:
            ax.set_xticks(panel.xticks)
            ax.set_xticklabels([_tick_label(x, panel.xlog2) for x in panel.xticks])
        if panel.ylog:
            ax.set_yscale("log")
        ax.set_xlabel(panel.xlabel)
        ax.set_title(panel.title)
        ax.grid(True, alpha=0.3)
        ax.legend(fontsize=7)
    for ax in list(axes.flat)[len(panels):]:
        ax.set_visible(False)
    if title:
        fig.suptitle(title)
    fig.tight_layout()
    path = Path(path)
    fig.savefig(path, dpi=120)
    plt.close(fig)
    return path


def draw_line_panels(panels: list[Panel], path: Path, *, columns: Optional[int] = None, title: str = "") -> Path:
    """:func:`write_line_panels` with the built-in rasteriser (no matplotlib): per panel a title, a
    legend (wrapped to the panel's width), grey grid lines at the ticks, square markers at the points."""
    import math
    panels = [p for p in panels if any(s.points for s in p.series)]
    if not panels:
        raise ValueError("line panels: no points to plot")
    columns = columns or len(panels)
    rows = -(-len(panels) // columns)
    panel_w, plot_h, left, right, bottom = 560, 300, 90, 30, 60
    grey, black = (200, 200, 200), (0, 0, 0)

    def legend_rows(panel):
        """[[(series, x offset), ...], ...]: legend entries wrapped at the panel's width."""
        out, x = [[]], 0
        for s in panel.series:
            width = 30 + Canvas.text_width(s.label) + 16
            if x and x + width > panel_w - 20:
                out.append([])
                x = 0
            out[-1].append((s, x))
            x += width
        return out

    head = 28 + 16 * max(len(legend_rows(p)) for p in panels) + 14
    panel_h = head + plot_h + bottom
    top = 30 if title else 0
    canvas = Canvas(panel_w * columns, top + panel_h * rows)
    if title:
        canvas.text(10, 10, title)
    for n, panel in enumerate(panels):
        ox, oy = (n % columns) * panel_w, top + (n // columns) * panel_h
        x0, y0, x1, y1 = ox + left, oy + head, ox + panel_w - right, oy + head + plot_h
        canvas.text(ox + 20, oy + 8, panel.title)
        for r, entries in enumerate(legend_rows(panel)):
            ly = oy + 34 + 16 * r
            for s, dx in entries:
                lx = ox + 20 + dx
                if s.join and s.dashed:
                    canvas.dashed(lx, ly + 4, lx + 22, ly + 4, s.colour, dash=5, gap=4)
                elif s.join:
                    canvas.line(lx, ly + 4, lx + 22, ly + 4, s.colour, thick=2)
                canvas.rect(lx + 9, ly + 2, lx + 13, ly + 6, s.colour)
                canvas.text(lx + 30, ly, s.label)

        def fx(x):
            return math.log2(x) if panel.xlog2 else x

        def fy(y):
            return math.log10(y) if panel.ylog else y

        pts = [(fx(x), fy(y)) for s in panel.series for x, y in s.points
               if (x > 0 or not panel.xlog2) and (y > 0 or not panel.ylog)]
        xs = [x for x, _ in pts] + [fx(t) for t in panel.xticks or []]
        xlo, xhi = min(xs), max(xs)
        pad = max(0.25 if panel.xlog2 else 0.0, 0.04 * (xhi - xlo)) or 0.5
        xlo, xhi = xlo - pad, xhi + pad
        ys = [y for _, y in pts]
        if panel.ylog:
            ylo, yhi = math.floor(min(ys)), math.ceil(max(ys))
            yhi = max(yhi, ylo + 1)
            ystep = max(1, math.ceil((yhi - ylo) / 8))
        else:
            ylo = 0.0 if min(ys) >= 0 else min(ys) * 1.1
            yhi = max(ys) * 1.1 if max(ys) > 0 else 0.0
            yhi = yhi if yhi > ylo else ylo + 1
            ystep = _nice_step(yhi - ylo)

        def px(x):
            return round(x0 + (fx(x) - xlo) / (xhi - xlo) * (x1 - x0))

        def py(y):
            return round(y1 - (fy(y) - ylo) / (yhi - ylo) * (y1 - y0))

        tick = math.ceil(ylo / ystep - 1e-9) * ystep
        while tick <= yhi + 1e-9:
            y = round(y1 - (tick - ylo) / (yhi - ylo) * (y1 - y0))
            canvas.line(x0, y, x1, y, grey)
            label = f"1e{int(tick)}" if panel.ylog else _tick_label(tick, False)
            canvas.text(x0 - 6 - Canvas.text_width(label), y - 5, label)
            tick += ystep
        if panel.xticks:
            xticks = sorted(panel.xticks)
        elif panel.xlog2:
            xticks = [2 ** e for e in range(math.ceil(xlo), math.floor(xhi) + 1)]
        else:
            xstep = _nice_step(xhi - xlo)
            xticks = [k * xstep for k in range(math.ceil(xlo / xstep), math.floor(xhi / xstep) + 1)]
        labels = [_tick_label(t, panel.xlog2) for t in xticks]
        gaps = [px(b) - px(a) for a, b in zip(xticks, xticks[1:])] or [x1 - x0]
        every = max(1, math.ceil((max(map(Canvas.text_width, labels)) + 10) / max(min(gaps), 1)))
        for i, (t, label) in enumerate(zip(xticks, labels)):
            canvas.line(px(t), y0, px(t), y1, grey)
            if (len(xticks) - 1 - i) % every == 0:          # the last tick is always labelled
                canvas.text(px(t) - Canvas.text_width(label) // 2, y1 + 8, label)
        canvas.line(x0, y0, x0, y1, black)
        canvas.line(x0, y1, x1, y1, black)
        if panel.xlabel:
            canvas.text((x0 + x1) // 2 - Canvas.text_width(panel.xlabel) // 2, y1 + 30, panel.xlabel)
        for s in panel.series:
            mine = [(x, y) for x, y in s.points if (x > 0 or not panel.xlog2) and (y > 0 or not panel.ylog)]
            points = [(px(x), py(y)) for x, y in (sorted(mine) if s.join else mine)]
            if s.join:
                for a, b in zip(points, points[1:]):
                    (canvas.dashed if s.dashed else canvas.line)(*a, *b, s.colour, thick=2)
            for x, y in points:
                canvas.rect(x - 3, y - 3, x + 3, y + 3, s.colour)
    path = Path(path)
    path.write_bytes(canvas.png())
    return path
