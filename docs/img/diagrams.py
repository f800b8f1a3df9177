"""Draw the request sequence, the lifecycle picture and the Grafana dashboard's layout as plain
SVG (no network, no plotting library, so the bytes depend on nothing installed):
``python docs/img/diagrams.py`` rewrites ``request_sequence.svg``, ``lifecycle.svg`` and
``dashboard.svg`` next to this file. The first two drawings are data here, the third is
``deploy/grafana-dashboard.json``'s panels; edit them and rerun (the suite checks that the
committed files are what this draws).
"""

from __future__ import annotations

import json
import re
from html import escape
from pathlib import Path

HERE = Path(__file__).parent
DASHBOARD = HERE.parents[1] / "deploy" / "grafana-dashboard.json"
FONT = "font-family='DejaVu Sans, Helvetica, Arial, sans-serif'"
INK = "#1f2933"
MUTED = "#52606d"
ACCENT = "#2563eb"
RELEASE = "#b45309"


class Svg:
    """A few primitives over an SVG document, enough for boxes, arrows and words."""

    def __init__(self, width: int, height: int, title: str) -> None:
        self.width = width
        self.height = height
        self.parts = [
            f"<svg xmlns='http://www.w3.org/2000/svg' viewBox='0 0 {width} {height}' "
            f"width='{width}' height='{height}' role='img' {FONT} font-size='12'>",
            f"<title>{escape(title)}</title>",
            "<defs><marker id='arrow' viewBox='0 0 10 10' refX='9' refY='5' markerWidth='7' "
            "markerHeight='7' orient='auto-start-reverse'><path d='M0,0 L10,5 L0,10 z' "
            f"fill='{INK}'/></marker></defs>",
            f"<rect width='{width}' height='{height}' fill='white'/>",
        ]

    def rect(self, x: float, y: float, w: float, h: float, **style: str) -> None:
        fill = style.get("fill", "none")
        stroke = style.get("stroke", INK)
        dash = f" stroke-dasharray='{style['dash']}'" if "dash" in style else ""
        self.parts.append(
            f"<rect x='{x}' y='{y}' width='{w}' height='{h}' rx='{style.get('rx', '4')}' "
            f"fill='{fill}' stroke='{stroke}'{dash}/>"
        )

    def line(self, x1: float, y1: float, x2: float, y2: float, **style: str) -> None:
        dash = f" stroke-dasharray='{style['dash']}'" if "dash" in style else ""
        head = " marker-end='url(#arrow)'" if style.get("arrow") else ""
        self.parts.append(
            f"<line x1='{x1}' y1='{y1}' x2='{x2}' y2='{y2}' stroke='{style.get('stroke', INK)}' "
            f"stroke-width='{style.get('width', '1.2')}'{dash}{head}/>"
        )

    def text(self, x: float, y: float, words: str, **style: str) -> None:
        anchor = style.get("anchor", "middle")
        weight = f" font-weight='{style['weight']}'" if "weight" in style else ""
        size = f" font-size='{style['size']}'" if "size" in style else ""
        italic = " font-style='italic'" if style.get("italic") else ""
        self.parts.append(
            f"<text x='{x}' y='{y}' text-anchor='{anchor}' fill='{style.get('fill', INK)}'"
            f"{weight}{size}{italic}>{escape(words)}</text>"
        )

    def save(self, path: Path) -> None:
        path.write_text("\n".join([*self.parts, "</svg>", ""]), encoding="utf-8")


# -- one request, across /encode, /send, the metadata pull and the release ----------------------

LANES = [
    "SGLang tokenizer",
    "prefill rank 0",
    "prefill rank 1",
    "HTTP handlers",
    "service + registry",
    "RequestScope r1",
    "registration ledger",
    "Mooncake engine",
]

# (kind, from lane, to lane, label): "call" solid, "answer" dashed, "note" on one lane,
# "band" a section title, "alt" an alternative frame's title (to lane = its row count).
STEPS: list[tuple[str, int, int, str]] = [
    ("band", 0, 0, "encode: every rank names the request; the encoder runs once"),
    ("call", 1, 3, "POST /encode r1, receive_count=2"),
    ("call", 3, 4, "encode(r1)"),
    ("call", 4, 5, "open: a task in the service nursery"),
    ("note", 5, 5, "encode task runs the encoder once"),
    ("call", 2, 3, "POST /encode r1"),
    ("call", 3, 4, "same scope: wait for that one run"),
    ("answer", 5, 4, "embedding published (shape, checksum)"),
    ("answer", 3, 1, "200 {embedding_size, ...}"),
    ("answer", 3, 2, "200, the same answer"),
    ("alt", 0, 4, "SGLang's dialect instead of the two /encode calls above"),
    ("call", 0, 3, "POST /encode r1 (no receive_count)"),
    ("call", 1, 3, "POST /scheduler_receive_meta_data r1"),
    ("note", 4, 4, "waits for the encode (arrivals, pull_timeout)"),
    ("answer", 3, 1, "200 sizes (rank 1 the same)"),
    ("band", 0, 0, "send: each rank's transfer is a task in the scope's nursery"),
    ("call", 1, 3, "POST /send r1 {session_id, buffer_address}"),
    ("call", 3, 5, "start attempt in the scope's nursery; wait"),
    ("call", 5, 6, "acquire a lease (first attempt)"),
    ("call", 6, 7, "register_memory(addr, n) -> 0, once"),
    ("call", 2, 3, "POST /send r1 {its own buffer}"),
    ("call", 3, 5, "start attempt; wait"),
    ("note", 5, 5, "the sibling reuses the lease"),
    ("call", 5, 7, "transfer_sync_write -> rank 0 (worker thread)"),
    ("call", 5, 7, "transfer_sync_write -> rank 1 (worker thread)"),
    ("answer", 3, 1, "200 {receivers_done: 1}"),
    ("answer", 3, 2, "200 {receivers_done: 2}"),
    ("band", 0, 0, "release: the scope's finally, shielded from cancellation"),
    ("note", 5, 5, "2 of 2 receivers done (or deadline, failure, shutdown)"),
    ("call", 5, 6, "release the lease"),
    ("call", 6, 7, "unregister_memory(addr): last lease"),
    ("note", 5, 5, "only then: drop the embedding"),
    ("call", 5, 4, "forget the scope; leave a tombstone"),
    ("band", 0, 0, "later: a call for an ended request gets the tombstone's answer"),
    ("call", 2, 3, "POST /send r1 again (its answer was lost)"),
    ("answer", 3, 2, "200 repeat: true (tombstone; a new receiver: 410)"),
]


def draw_sequence(path: Path) -> None:
    lane_w, left, top, row = 128, 14, 56, 27
    width = left * 2 + lane_w * len(LANES)
    height = top + row * (len(STEPS) + 1) + 30
    svg = Svg(width, height, "One request across /encode, /send and the scope's release")

    def x(lane: int) -> float:
        return left + lane_w * lane + lane_w / 2

    for lane, name in enumerate(LANES):
        dashed = {"dash": "4 3"} if lane == 0 else {}
        svg.rect(x(lane) - 58, 10, 116, 30, fill="#eef2ff" if lane == 5 else "#f5f7fa", **dashed)
        svg.text(x(lane), 30, name, weight="bold" if lane == 5 else "normal")
        svg.line(x(lane), 40, x(lane), height - 12, stroke="#cbd2d9", dash="3 3")
    y = top
    color = INK
    for kind, source, target, label in STEPS:
        y += row
        if kind == "band":
            color = RELEASE if label.startswith("release") else INK
            svg.line(left, y - 8, width - left, y - 8, stroke=MUTED, width="0.6")
            svg.text(left + 4, y + 6, label, anchor="start", weight="bold", fill=MUTED)
            continue
        if kind == "alt":
            svg.rect(left + 2, y - 12, x(target) + 70 - left, row * 4 + 26, dash="5 3")
            svg.text(left + 8, y + 4, "alt: " + label, anchor="start", italic="1", fill=MUTED)
            continue
        if kind == "note":
            half = max(60, len(label) * 3.2 + 10)
            svg.rect(x(source) - half, y - 9, 2 * half, 19, fill="#fffbea", stroke="#d9c77a")
            svg.text(x(source), y + 5, label, size="11")
            continue
        dash = {"dash": "5 3"} if kind == "answer" else {}
        y_line = y + 6
        svg.line(x(source), y_line, x(target), y_line, arrow="1", stroke=color, **dash)
        middle = (x(source) + x(target)) / 2
        svg.text(middle, y_line - 5, label, size="11", fill=ACCENT if kind == "call" else MUTED)
    svg.save(path)


# -- the lifecycle picture: who lives inside whom, and how a scope ends -------------------------


def draw_lifecycle(path: Path) -> None:
    svg = Svg(940, 520, "The request lifecycle: nurseries, and the ways a scope ends")
    svg.text(20, 26, "Who lives inside whom", anchor="start", weight="bold", size="14")
    svg.rect(20, 40, 560, 260, fill="#f5f7fa")
    svg.text(32, 60, "service nursery (as long as the server runs)", anchor="start", weight="bold")
    svg.rect(36, 72, 150, 30, fill="white")
    svg.text(111, 92, "encoder batching task")
    svg.rect(36, 112, 150, 30, fill="white")
    svg.text(111, 132, "registration ledger task")
    svg.rect(200, 72, 366, 214, fill="#eef2ff", stroke=ACCENT)
    svg.text(212, 92, "RequestScope r1: one task per req_id", anchor="start", weight="bold")
    svg.rect(214, 102, 338, 148, fill="white", stroke=ACCENT, dash="5 3")
    svg.text(226, 120, "scope nursery (deadline = opened + send_timeout)", anchor="start")
    for i, label in enumerate(
        [
            "encode task: the encoder, once",
            "send attempt, rank 0: lease -> transfer",
            "send attempt, rank 1: reuses the lease",
        ]
    ):
        svg.rect(228, 130 + i * 36, 310, 28, fill="#f8fafc")
        svg.text(383, 149 + i * 36, label)
    svg.text(383, 272, "finally (shielded): release lease, then drop embedding", fill=RELEASE)
    svg.rect(36, 152, 150, 30, fill="white", dash="4 3")
    svg.text(111, 172, "RequestScope r2 ...")

    svg.rect(620, 40, 300, 260, fill="#fdfdfd", dash="4 3")
    svg.text(632, 60, "HTTP handlers (one per call)", anchor="start", weight="bold")
    for i, label in enumerate(["/encode: open or join, wait", "/send: start an attempt, wait"]):
        svg.rect(636, 76 + i * 44, 268, 30, fill="white")
        svg.text(770, 96 + i * 44, label)
    svg.text(770, 190, "a handler joins the scope: it starts", fill=MUTED)
    svg.text(770, 206, "work there and waits for the outcome,", fill=MUTED)
    svg.text(770, 222, "so its disconnect cannot take a", fill=MUTED)
    svg.text(770, 238, "running transfer down with it", fill=MUTED)
    svg.line(636, 135, 540, 185, arrow="1", stroke=ACCENT, dash="5 3")
    svg.line(636, 91, 540, 145, arrow="1", stroke=ACCENT, dash="5 3")

    svg.text(20, 340, "How a scope ends", anchor="start", weight="bold", size="14")
    states = [
        (20, "opened", "by the first /encode"),
        (170, "encoding", "siblings wait"),
        (320, "serving sends", "one lease, shared"),
        (470, "ending", "see the causes below"),
        (620, "released", "deregistered, dropped"),
        (770, "tombstone", "bounded, then gone"),
    ]
    for x, name, note in states:
        fill = "#fff7ed" if name in ("ending", "released") else "#f5f7fa"
        svg.rect(x, 356, 130, 46, fill=fill)
        svg.text(x + 65, 376, name, weight="bold")
        svg.text(x + 65, 393, note, size="11", fill=MUTED)
    for x, _, _ in states[:-1]:
        svg.line(x + 130, 379, x + 150, 379, arrow="1")
    causes = [
        "receive_count distinct receivers are done: completed",
        "the encode failed: every waiting and later call gets its 500",
        "the backstop deadline fired: waiting sends get 504",
        "the server shuts down: waiting calls get 503",
        "bad input or a full queue ends it with no tombstone: retry the req_id at once",
    ]
    for i, cause in enumerate(causes):
        svg.text(470, 430 + i * 18, "- " + cause, anchor="start", size="11")
    svg.text(
        20,
        430,
        "A transfer already running completes and counts:",
        anchor="start",
        size="11",
        fill=RELEASE,
    )
    svg.text(
        20,
        448,
        "the nursery waits for its thread before release.",
        anchor="start",
        size="11",
        fill=RELEASE,
    )
    svg.text(
        20,
        476,
        "A call after the end gets the tombstone's answer:",
        anchor="start",
        size="11",
    )
    svg.text(20, 494, "410, the original error, or a repeat 200.", anchor="start", size="11")
    svg.save(path)


# -- the Grafana dashboard: its panels where Grafana puts them, each with what it queries ---------


def draw_dashboard(path: Path) -> None:
    dashboard = json.loads(DASHBOARD.read_text(encoding="utf-8"))
    column, unit, top, pad = 40, 13, 48, 6  # Grafana's grid: 24 columns, rows of h units
    bottom = max(p["gridPos"]["y"] + p["gridPos"]["h"] for p in dashboard["panels"])
    svg = Svg(24 * column + 2 * pad, top + bottom * unit + pad, "The trio-encode dashboard")
    svg.text(
        pad + 4, 28, f"Grafana: {dashboard['title']}", anchor="start", weight="bold", size="15"
    )
    svg.text(
        24 * column + pad - 4,
        28,
        "deploy/grafana-dashboard.json: each panel and the metrics it queries",
        anchor="end",
        fill=MUTED,
        size="11",
    )
    for panel in dashboard["panels"]:
        box = panel["gridPos"]
        x, y = pad + box["x"] * column, top + box["y"] * unit
        svg.rect(x + 3, y + 3, box["w"] * column - 6, box["h"] * unit - 6, fill="#f8fafc")
        svg.text(x + 14, y + 24, panel["title"], anchor="start", weight="bold")
        metrics: list[str] = []
        for target in panel["targets"]:
            for name in re.findall(r"\b(?:trio_encode|process)_\w+", target["expr"]):
                short = re.sub(r"_(bucket|sum|count)$", "", name.removeprefix("trio_encode_"))
                if short not in metrics:
                    metrics.append(short)
        for line, name in enumerate(metrics[:4]):
            svg.text(x + 14, y + 46 + 16 * line, name, anchor="start", fill=ACCENT, size="11")
    svg.save(path)


DRAWINGS = {
    "request_sequence.svg": draw_sequence,
    "lifecycle.svg": draw_lifecycle,
    "dashboard.svg": draw_dashboard,
}
"""Each file this script owns, and what draws it."""


def draw_all(directory: Path) -> None:
    for name, draw in DRAWINGS.items():
        draw(directory / name)


if __name__ == "__main__":
    draw_all(HERE)
