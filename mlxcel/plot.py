"""summary.png of a sweep, drawn with Pillow (no plotting library: Pillow is already a dependency).

The first swept parameter is the x axis (numeric when every value is a number, log-scaled when
they span a wide range like chunk sizes 16..2048; categorical otherwise). Three panels: prefill
tok/s, decode tok/s, TTFT ms. One line per combination of the other swept values. Failed jobs
are left out of the plot (they are in the CSV).
"""

from __future__ import annotations

import math
from collections import Counter
from pathlib import Path
from typing import Any

from PIL import Image, ImageDraw, ImageFont

PANELS = (("prefill_tok_per_sec", "prefill tok/s"), ("decode_tok_per_sec", "decode tok/s"), ("ttft_ms", "TTFT ms"))
COLORS = ("#1f77b4", "#ff7f0e", "#2ca02c", "#d62728", "#9467bd", "#8c564b", "#e377c2", "#7f7f7f", "#bcbd22", "#17becf")
WIDTH, PANEL_H, TOP, PAD = 1500, 420, 70, 24
LEFT, BOTTOM = 78, 64  # room for y tick labels + axis label; x tick labels + axis label
GRID, AXIS, TEXT = "#e3e3e3", "#444444", "#222222"


def load_font(size: int) -> Any:
    try:
        return ImageFont.load_default(size=size)  # Pillow >= 10.1 ships a scalable font
    except TypeError:
        return ImageFont.load_default()


def is_number(value: Any) -> bool:
    return isinstance(value, (int, float)) and not isinstance(value, bool) and math.isfinite(value)


def format_number(value: float) -> str:
    if abs(value) >= 1e5:
        return f"{value:.3g}"
    return f"{value:.0f}" if float(value).is_integer() or abs(value) >= 100 else f"{value:.3g}"


def make_x_scale(values: list[Any]) -> tuple[Any, list[tuple[float, str]], str]:
    """(value -> position in [0, 1], ticks as (position, label), scale kind)."""
    distinct = list(dict.fromkeys(values))
    if distinct and all(is_number(v) for v in distinct):
        low, high = min(distinct), max(distinct)
        log = low > 0 and high / low >= 20
        f = (lambda v: math.log10(v)) if log else (lambda v: float(v))
        span = f(high) - f(low)
        position = (lambda v: 0.5) if span == 0 else (lambda v: 0.04 + 0.92 * (f(v) - f(low)) / span)
        marks = sorted(distinct) if len(distinct) <= 10 else make_nice_ticks(low, high, 6, log)
        return position, [(position(v), format_number(v)) for v in marks], "log" if log else "linear"
    labels = [format_value(v) for v in distinct]
    slot = {label: i for i, label in enumerate(labels)}

    def position(v: Any) -> float:
        return (slot[format_value(v)] + 0.5) / len(labels)

    return position, [(position(label), shorten(label, 14)) for label in labels], "categorical"


def make_nice_ticks(low: float, high: float, count: int, log: bool = False) -> list[float]:
    if log:
        return [
            10.0**e
            for e in range(math.floor(math.log10(low)), math.ceil(math.log10(high)) + 1)
            if low <= 10.0**e <= high
        ]
    step = nice_step((high - low) / max(count - 1, 1))
    start = math.ceil(low / step) * step
    return [start + i * step for i in range(int((high - start) / step + 1e-9) + 1)]


def nice_step(raw: float) -> float:
    """1, 2 or 5 times a power of ten, at least `raw`."""
    if raw <= 0:
        return 1.0
    power = 10 ** math.floor(math.log10(raw))
    return next(m * power for m in (1, 2, 5, 10) if m * power >= raw - 1e-12)


def format_value(value: Any) -> str:
    """A swept value as it was typed on the command line (true, null), not as Python prints it."""
    if isinstance(value, bool) or value is None:
        return {True: "true", False: "false", None: "null"}[value]
    return str(value)


def shorten(text: str, limit: int) -> str:
    return text if len(text) <= limit else text[: limit - 1] + "…"


def group_lines(rows: list[dict], x_key: str, others: list[str]) -> dict[str, list[tuple[Any, dict]]]:
    """Completed rows grouped by the values of the other swept keys: legend label -> [(x, row)]."""
    lines: dict[str, list[tuple[Any, dict]]] = {}
    for row in rows:
        if row.get("status") != "completed":
            continue
        params = row.get("params") or {}
        x = row.get("job") if x_key == "job" else params.get(x_key)
        label = ", ".join(f"{key}={format_value(params.get(key))}" for key in others) or "all jobs"
        lines.setdefault(label, []).append((x, row))
    return lines


def draw_sweep_plot(rows: list[dict], swept: list[str], path: Path, title: str = "mlxcel sweep") -> None:
    x_key, others = (swept[0], swept[1:]) if swept else ("job", [])
    lines = group_lines(rows, x_key, others)
    position, ticks, kind = make_x_scale([x for points in lines.values() for x, _ in points])
    fonts = {size: load_font(size) for size in (13, 15, 20)}
    legend = [(label, COLORS[i % len(COLORS)]) for i, label in enumerate(lines)]
    legend_rows = layout_legend(legend, fonts[13])
    height = TOP + PANEL_H + 16 + 22 * len(legend_rows) + PAD
    image = Image.new("RGB", (WIDTH, height), "white")
    draw = ImageDraw.Draw(image)
    others = Counter(str(row.get("status")) for row in rows if row.get("status") != "completed")
    subtitle = f"{len(rows)} jobs" + (
        ", " + ", ".join(f"{n} {status}" for status, n in others.items()) + " (not plotted)" if others else ""
    )
    draw.text((PAD, 14), title, fill=TEXT, font=fonts[20])
    draw.text((PAD, 42), subtitle, fill="#666666", font=fonts[13])
    panel_w = (WIDTH - 2 * PAD) // len(PANELS)
    for i, (field, label) in enumerate(PANELS):
        box = (PAD + i * panel_w + LEFT, TOP + 28, PAD + (i + 1) * panel_w - 18, TOP + PANEL_H - BOTTOM)
        draw_panel(
            image,
            draw,
            box,
            field,
            label,
            lines,
            position,
            ticks,
            f"{x_key} ({kind})" if kind == "log" else x_key,
            fonts,
        )
    y = TOP + PANEL_H + 16
    for line in legend_rows:
        x = PAD + LEFT
        for label, color in line:
            draw.line((x, y + 8, x + 24, y + 8), fill=color, width=3)
            draw.ellipse((x + 8, y + 4, x + 16, y + 12), fill=color)
            draw.text((x + 32, y), label, fill=TEXT, font=fonts[13])
            x += 32 + text_width(draw, label, fonts[13]) + 28
        y += 22
    image.save(path, format="PNG")


def layout_legend(legend: list[tuple[str, str]], font: Any) -> list[list[tuple[str, str]]]:
    """Legend entries wrapped into rows that fit the image width."""
    if len(legend) <= 1 and (not legend or legend[0][0] == "all jobs"):
        return []  # one unnamed line needs no legend
    probe = ImageDraw.Draw(Image.new("RGB", (1, 1)))
    rows: list[list[tuple[str, str]]] = [[]]
    used = 0
    for label, color in legend:
        label = shorten(label, 90)
        width = 32 + text_width(probe, label, font) + 28
        if rows[-1] and used + width > WIDTH - 2 * PAD - LEFT:
            rows.append([])
            used = 0
        rows[-1].append((label, color))
        used += width
    return rows


def text_width(draw: ImageDraw.ImageDraw, text: str, font: Any) -> int:
    left, _, right, _ = draw.textbbox((0, 0), text, font=font)
    return right - left


def draw_panel(image, draw, box, field, label, lines, position, ticks, x_label, fonts) -> None:
    x0, y0, x1, y1 = box
    values = [row.get(field) for points in lines.values() for _, row in points if is_number(row.get(field))]
    draw.text((x0, y0 - 26), label, fill=TEXT, font=fonts[15])
    # The y axis starts at 0 (throughputs compare as ratios) and ends on a round tick above the data.
    step = nice_step(max(values) * 1.05 / 5) if values and max(values) > 0 else 0.2
    top = math.ceil((max(values) * 1.05 if values else 1.0) / step) * step
    y_ticks = make_nice_ticks(0.0, top, int(round(top / step)) + 1)

    def to_xy(x: Any, v: float) -> tuple[float, float]:
        return x0 + position(x) * (x1 - x0), y1 - (v / top) * (y1 - y0)

    for v in y_ticks:
        y = y1 - (v / top) * (y1 - y0)
        draw.line((x0, y, x1, y), fill=GRID)
        text = format_number(v)
        draw.text((x0 - 8 - text_width(draw, text, fonts[13]), y - 8), text, fill=AXIS, font=fonts[13])
    for p, text in ticks:
        x = x0 + p * (x1 - x0)
        draw.line((x, y1, x, y1 + 5), fill=AXIS)
        draw.text((x - text_width(draw, text, fonts[13]) / 2, y1 + 8), text, fill=AXIS, font=fonts[13])
    draw.rectangle(box, outline=AXIS)
    draw.text(((x0 + x1) / 2 - text_width(draw, x_label, fonts[13]) / 2, y1 + 30), x_label, fill=TEXT, font=fonts[13])
    paste_vertical_text(image, label, fonts[13], (x0 - 74, (y0 + y1) // 2))
    if not values:
        draw.text(((x0 + x1) / 2 - 40, (y0 + y1) / 2), "no data", fill="#999999", font=fonts[15])
    for i, points in enumerate(lines.values()):
        color = COLORS[i % len(COLORS)]
        numeric = all(is_number(x) for x, _ in points)
        ordered = sorted(points, key=lambda p: p[0]) if numeric else points
        xy = [to_xy(x, row[field]) for x, row in ordered if is_number(row.get(field))]
        if len(xy) > 1:
            draw.line(xy, fill=color, width=3, joint="curve")
        for x, y in xy:
            draw.ellipse((x - 5, y - 5, x + 5, y + 5), fill=color, outline="white")


def paste_vertical_text(image: Image.Image, text: str, font: Any, center: tuple[int, int]) -> None:
    """An axis label turned 90 degrees (Pillow draws text horizontally only)."""
    probe = ImageDraw.Draw(image)
    left, top, right, bottom = probe.textbbox((0, 0), text, font=font)
    label = Image.new("RGBA", (right - left + 4, bottom - top + 4), (255, 255, 255, 0))
    ImageDraw.Draw(label).text((2 - left, 2 - top), text, fill=TEXT, font=font)
    label = label.rotate(90, expand=True)
    x, y = center
    image.paste(label, (x, y - label.height // 2), label)
