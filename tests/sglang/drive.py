"""SGLang 0.5.23's own receiver code, unmodified, against real ``trio-encode serve`` processes.

Run by ``nox -s sglang`` in an environment with the ``sglang==0.5.23`` wheel (installed without
its dependencies) and what its receiver modules import. Two servers; TP rank processes, each
with SGLang's ``MooncakeTransferEngine`` (TCP), SGLang's ``EmbeddingPool`` logic and, per
request, SGLang's ``WaitingRDMARequest`` polled as its scheduler polls it
(``_try_recv_mm_data`` every tick); the tokenizer's dispatch is SGLang's
``MMReceiverHTTP.encode``. The servers serve a tiny random-weight Qwen2.5-VL (its image and
video paths), then a tiny Qwen2-Audio (its audio path). A request passes when every rank ends
``SUCCESS``, the bytes SGLang hands its model processor equal, part by part, the checksum
``/encode`` reports for those items, and the grids, video metadata and clip lengths SGLang
hands it equal what ``/encode`` reports (or, for a bad item, when every rank aborts at once
with our error). A request of images and a video is split by SGLang into parts of both
modalities, on both servers.

What is not SGLang's own code here, and why:

- ``torchvision`` is a stub package (``tests/sglang/stubs``): its CPU build for this torch is
  not installable here, and SGLang imports it only for model preprocessors this path never
  runs (InternVL and others).
- The landing pool is SGLang's ``EmbeddingPool`` with only its constructor replaced, to
  allocate CPU memory instead of ``cuda:N`` (this machine has no GPU); allocation, release and
  the engine registration are SGLang's.
- The model's multimodal processor (``mm_processor``) records the embedding it is handed
  instead of building model inputs; SGLang's receiver calls it exactly as it calls a real one.
- The scheduler's TP-wide status all-reduce is left out: each rank's own status is checked.
- ``MMReceiverHTTP`` is made without its constructor (which needs a whole server's arguments),
  with the two attributes its ``encode`` reads: the encoder URLs and this host.
"""

from __future__ import annotations

import asyncio
import base64
import io
import multiprocessing as mp
import os
import random
import socket
import subprocess
import sys
import tempfile
import threading
import time
from types import SimpleNamespace
from typing import Any

import httpx
import xxhash
from PIL import Image

HOST = "127.0.0.1"
POLL = 0.005
REQUEST_LIMIT = 60.0
"""Seconds a rank waits for its request before the driver calls it stuck."""
QUICK = 5.0
"""Seconds within which a bad request must abort on every rank (SGLang's own timeout: 180)."""


# -- the rank processes ---------------------------------------------------------------------


def rank_main(rank: int, conn: Any) -> None:
    """One TP rank: SGLang's engine and pool, then one ``WaitingRDMARequest`` per command."""
    os.environ.setdefault("MOONCAKE_PROTOCOL", "tcp")
    import torch
    import zmq
    from sglang.srt.disaggregation.encoder import receiver as sgl
    from sglang.srt.distributed.device_communicators.mooncake_transfer_engine import (
        MooncakeTransferEngine,
    )
    from sglang.srt.managers.schedule_batch import Modality

    class CpuEmbeddingPool(sgl.EmbeddingPool):
        """SGLang's pool with its buffer in CPU memory (the only change)."""

        def __init__(self, size_bytes: int, engine: Any) -> None:
            self.gpu_id = 0
            self.size_bytes = size_bytes
            self.buffer = torch.zeros(size_bytes, dtype=torch.uint8)
            self.base = self.buffer.data_ptr()
            self.engine = engine
            engine.register(self.base, self.buffer.nbytes)
            self._segments_free = [(0, size_bytes)]
            self._inflight = {}
            self._next_slot_id = 0
            self._total_inflight = 0
            self._lock = threading.Lock()
            self._cond = threading.Condition(self._lock)

    class ModelInputs:
        """What a processor returns (SGLang ties the pool slot's release to its lifetime)."""

        input_ids = [1, 2, 3]
        mm_items: list[Any] = []

    class RecordingProcessor:
        """Stands for the model's processor: keeps the bytes SGLang hands it, by modality."""

        prefer_tokenized_input = True

        def __init__(self) -> None:
            self.handed: dict[str, bytes] | None = None
            self.extra: dict[str, Any] = {}

        def get_validated_mm_data(self, prompt: Any, embedding: Any, **extra: Any) -> Any:
            self.handed = {
                modality.name: bytes(rows.contiguous().view(torch.uint8).numpy())
                for modality, rows in embedding.items()
            }
            self.extra = extra
            return ModelInputs()

    engine = MooncakeTransferEngine(hostname=HOST)
    pool = CpuEmbeddingPool(256 << 20, engine)
    context = zmq.Context()
    conn.send(("ready", rank))
    while (command := conn.recv()) is not None:
        processor = RecordingProcessor()
        recv_req = SimpleNamespace(
            rid=command["rid"],
            num_items_assigned={
                Modality[name]: counts for name, counts in command["assignment"].items()
            },
            input_ids=[1, 2, 3],
            input_text=None,
        )
        waiting = sgl.WaitingRDMARequest(
            rid=command["rid"],
            recv_req=recv_req,
            mm_processor=processor,
            encoder_urls=command["urls"],
            host_name=HOST,
            receive_count=command["tp"],
            zmq_context=context,
            embeddings_engine=engine,
            dtype=torch.float32,
            gpu_id=0,
            embedding_pool=pool,
        )
        started = time.monotonic()
        waiting.send_encode_request()
        while waiting.status == sgl.WaitingMMRequestStatus.PENDING:
            if time.monotonic() - started > REQUEST_LIMIT:
                break
            waiting._try_recv_mm_data()  # what the scheduler does each tick
            time.sleep(POLL)
        seconds = time.monotonic() - started
        parts: list[str] = []
        data = waiting.recv_embedding_data
        if processor.handed is not None and data is not None:
            offsets = dict.fromkeys(processor.handed, 0)
            for modality, shape in zip(data.modality_list, data.embedding_shape_list, strict=True):
                size, offset = shape[0] * shape[1] * 4, offsets[modality.name]
                rows = processor.handed[modality.name][offset : offset + size]
                parts.append(f"xxh3-64:{xxhash.xxh3_64_hexdigest(rows)}")
                offsets[modality.name] += size
        extra = processor.extra
        conn.send(
            {
                "rank": rank,
                "status": waiting.status.name,
                "error_msg": waiting.error_msg,
                "error_code": waiting.error_code,
                "seconds": seconds,
                "checksums": parts,
                "grids": {
                    name: None if extra.get(name) is None else extra[name].tolist()
                    for name in GRID_NAMES.values()
                },
                "second_per_grid_ts": extra.get("second_per_grid_ts"),
            }
        )
        waiting.release_resources()
        waiting.close_recv_socket()
    context.term()


# -- the driver -----------------------------------------------------------------------------


def free_port() -> int:
    with socket.socket() as probe:
        probe.bind((HOST, 0))
        return int(probe.getsockname()[1])


def png(seed: int) -> str:
    rng = random.Random(seed)
    image = Image.new("RGB", (48 + seed % 5 * 8, 40), tuple(rng.randrange(256) for _ in range(3)))
    for _ in range(50):
        image.putpixel((rng.randrange(image.width), rng.randrange(image.height)), (0, 0, 0))
    buffer = io.BytesIO()
    image.save(buffer, format="PNG")
    return "data:image/png;base64," + base64.b64encode(buffer.getvalue()).decode()


BAD = "data:image/png;base64," + base64.b64encode(b"\x89PNG\r\n\x1a\n" + b"\0" * 64).decode()
"""A PNG signature and nothing decodable: found bad only when the image is decoded."""


def mp4(seed: int, frames: int = 10, rate: int = 4) -> str:
    """A small H.264 video whose frames differ (a gradient moving with the frame's index)."""
    from trio_encode.testing.videos import write_video

    data = write_video(frames, rate, 64, 48, first=seed * 101)
    return "data:video/mp4;base64," + base64.b64encode(data).decode()


def wav(seed: int, seconds: float = 1.5, rate: int = 16_000) -> str:
    """A mono 16-bit WAV of a tone whose pitch follows the seed (the server resamples it to
    the model's rate)."""
    from trio_encode.testing.audio import tone, write

    data = write("wav", rate, samples=tone(rate, seconds, pitch=220.0 + 55.0 * seed))
    return "data:audio/wav;base64," + base64.b64encode(data).decode()


BAD_AUDIO = (
    "data:audio/wav;base64," + base64.b64encode(b"RIFF\x24\0\0\0WAVEfmt " + b"\0" * 40).decode()
)
"""A RIFF/WAVE header and nothing playable: found bad only when the clip is decoded."""


GRID_NAMES = {"IMAGE": "img_grid_thw", "VIDEO": "video_grid_thw", "AUDIO": "audio_feature_lens"}
"""Where SGLang's receiver hands its model processor each modality's grids."""


BAD_VIDEO = "data:video/mp4;base64," + base64.b64encode(b"\0\0\0\x18ftypmp42" + b"\0" * 64).decode()
"""An MP4 box and no video in it: found bad only when the video is decoded."""


SERVER_ENV = {name: value for name, value in os.environ.items() if name != "PYTHONPATH"}
"""The servers' environment: without the torchvision stub, which SGLang's modules need but
transformers would take for the real package (and run its fast image processors on it)."""


def start_server(port: int, model: str) -> subprocess.Popen[bytes]:
    return subprocess.Popen(
        [
            sys.executable,
            "-m",
            "trio_encode",
            "serve",
            "--port",
            str(port),
            "--engine-protocol",
            "tcp",
            "--engine-hostname",
            HOST,
            "--send-timeout",
            "30",
            "--shutdown-grace",
            "0",
            "--dtype",
            "float32",
            "--log-level",
            "WARNING",
            "--model",
            model,
        ],
        env=SERVER_ENV | {"MC_LOG_LEVEL": "ERROR"},
    )


def wait_ready(url: str) -> None:
    deadline = time.monotonic() + 300
    while time.monotonic() < deadline:
        try:
            if httpx.get(url + "/readyz", timeout=2).status_code == 200:
                return
        except httpx.HTTPError:
            pass
        time.sleep(0.5)
    raise RuntimeError(f"{url} never became ready")


def encoded(url: str, items: list[str], tag: str, modality: str) -> dict[str, Any]:
    """What ``/encode`` reports for these items (a fresh id: the request under test is gone)."""
    body = {"req_id": tag, "mm_items": items, "receive_count": 1, "modality": modality}
    answer: dict[str, Any] = httpx.post(url + "/encode", json=body, timeout=120).json()
    return answer


Items = list[tuple[str, str]]
"""(SGLang's modality name, item), in the request's order."""


def dispatch(urls: list[str], rid: str, items: Items, assignment: dict[str, list[int]]) -> Any:
    """SGLang's tokenizer: ``MMReceiverHTTP.encode`` over the two servers."""
    from sglang.srt.disaggregation.encoder import receiver as sgl
    from sglang.srt.managers.schedule_batch import Modality

    tokenizer = object.__new__(sgl.MMReceiverHTTP)
    tokenizer.encode_urls = urls
    tokenizer.host = HOST
    mm_data = [{"url": item, "modality": Modality[modality]} for modality, item in items]
    return asyncio.run(
        tokenizer.encode(
            req_id=rid,
            mm_data=mm_data,
            embedding_port=None,
            endpoint_encode="encode",
            num_items_assigned={Modality[name]: counts for name, counts in assignment.items()},
            encode_urls=urls,
        )
    )


def images(*items: str) -> Items:
    return [("IMAGE", item) for item in items]


Scenario = tuple[str, Items, dict[str, list[int]], bool, bool]
"""Its name, items, items per server by modality, pulls before /encode, expect success."""

VL_SCENARIOS: list[Scenario] = [
    ("one image", images(png(1)), {"IMAGE": [1, 0]}, False, True),
    ("several images", images(png(2), png(3), png(4)), {"IMAGE": [3, 0]}, False, True),
    ("two parts on two servers", images(png(5), png(6), png(7)), {"IMAGE": [2, 1]}, False, True),
    ("pulls before /encode", images(png(8), png(9)), {"IMAGE": [1, 1]}, True, True),
    ("a bad image", images(BAD), {"IMAGE": [1, 0]}, False, False),
    ("a bad image in one of two parts", images(png(10), BAD), {"IMAGE": [1, 1]}, False, False),
    (
        "an image and a video, two servers",
        [("IMAGE", png(11)), ("VIDEO", mp4(1))],
        {"IMAGE": [1, 0], "VIDEO": [0, 1]},
        False,
        True,
    ),
    (
        "two videos and an image",
        [("VIDEO", mp4(2)), ("IMAGE", png(12)), ("VIDEO", mp4(3, frames=17, rate=6))],
        {"VIDEO": [1, 1], "IMAGE": [1, 0]},
        False,
        True,
    ),
    (
        "a bad video beside an image",
        [("IMAGE", png(13)), ("VIDEO", BAD_VIDEO)],
        {"IMAGE": [1, 0], "VIDEO": [0, 1]},
        False,
        False,
    ),
]


AUDIO_SCENARIOS: list[Scenario] = [
    ("one clip", [("AUDIO", wav(1))], {"AUDIO": [1, 0]}, False, True),
    (
        "three clips on two servers",
        [("AUDIO", wav(2)), ("AUDIO", wav(3, seconds=4.0)), ("AUDIO", wav(4, rate=44_100))],
        {"AUDIO": [2, 1]},
        False,
        True,
    ),
    ("pulls before /encode", [("AUDIO", wav(5)), ("AUDIO", wav(6))], {"AUDIO": [1, 1]}, True, True),
    (
        "a bad clip beside a good one",
        [("AUDIO", wav(7)), ("AUDIO", BAD_AUDIO)],
        {"AUDIO": [1, 1]},
        False,
        False,
    ),
]


def run_scenario(
    ranks: list[Any], urls: list[str], tp: int, number: int, scenario: tuple[Any, ...]
) -> list[str]:
    name, items, assignment, pulls_first, succeeds = scenario
    rid = f"tp{tp}-{number}"
    command = {"rid": rid, "urls": urls, "assignment": assignment, "tp": tp}
    outcome: dict[str, Any] = {}

    def tokenizer() -> None:
        outcome["dispatch"] = dispatch(urls, rid, items, assignment)

    thread = threading.Thread(target=tokenizer)
    if pulls_first:
        for conn in ranks[:tp]:
            conn.send(command)
        time.sleep(1.0)  # every rank's pulls are waiting before the /encode arrives
        thread.start()
    else:
        thread.start()
        for conn in ranks[:tp]:
            conn.send(command)
    results = [conn.recv() for conn in ranks[:tp]]
    thread.join()
    problems: list[str] = []
    if succeeds:
        expected: list[str] = []
        grids: dict[str, list[list[int]] | None] = {}
        seconds: list[float] = []
        for modality, counts in assignment.items():  # SGLang numbers parts in this order
            of_modality = [item for name, item in items if name == modality]
            offset = 0
            for server, count in enumerate(counts):
                if count:
                    tag = f"check-{rid}-{modality}-{server}"
                    answer = encoded(
                        urls[server], of_modality[offset : offset + count], tag, modality
                    )
                    expected.append(str(answer["checksum"]))
                    key = GRID_NAMES[modality]
                    grid = answer["grid_dim"]
                    if modality == "AUDIO":  # SGLang's receiver flattens audio's lengths
                        grid = [value for row in grid for value in row]
                    grids[key] = (grids.get(key) or []) + grid
                    seconds += answer.get("second_per_grid_ts", [])
                    offset += count
        if outcome["dispatch"] is not None:
            problems.append(f"tokenizer: {outcome['dispatch']}")
        for result in results:
            got = {name: grid for name, grid in result["grids"].items() if grid is not None}
            if result["status"] != "SUCCESS":
                problems.append(f"rank {result['rank']}: {result['status']} {result['error_msg']}")
            elif result["checksums"] != expected:
                problems.append(f"rank {result['rank']}: {result['checksums']} != {expected}")
            elif got != grids:
                problems.append(f"rank {result['rank']}: grids {got} != {grids}")
            elif (result["second_per_grid_ts"] or []) != seconds:
                problems.append(
                    f"rank {result['rank']}: second_per_grid_ts "
                    f"{result['second_per_grid_ts']} != {seconds}"
                )
    else:
        for result in results:
            if result["status"] != "FAIL" or result["seconds"] > QUICK:
                problems.append(f"rank {result['rank']}: {result}")
            elif "mm_items[0]" not in str(result["error_msg"]):
                problems.append(f"rank {result['rank']}: not our error: {result['error_msg']}")
        if outcome["dispatch"] is None:
            problems.append("tokenizer: the bad /encode was not reported")
    slowest = max(r["seconds"] for r in results)
    verdict = "ok" if not problems else "FAILED"
    print(
        f"TP={tp} {name:34s} {verdict:6s} slowest rank {slowest:6.2f} s "
        f"({results[0]['status']}: {results[0]['error_msg'] or 'bytes match /encode'})",
        flush=True,
    )
    return [f"TP={tp} {name}: {p}" for p in problems]


DEPLOYMENTS: list[tuple[str, list[Scenario]]] = [
    ("qwen2_5_vl", VL_SCENARIOS),
    ("qwen2_audio", AUDIO_SCENARIOS),
]
"""Each model served by two servers in turn, with the scenarios its modalities allow."""


def serve_model(model_type: str) -> tuple[list[str], list[subprocess.Popen[bytes]]]:
    """Two ready servers of a tiny random-weight model of this family."""
    ports = [free_port(), free_port()]
    urls = [f"http://{HOST}:{port}" for port in ports]
    model = tempfile.mkdtemp(prefix=f"tiny-{model_type}-")
    subprocess.run(
        [sys.executable, "-m", "trio_encode", "make-tiny-model", model_type, model],
        check=True,
        env=SERVER_ENV,
    )
    servers = [start_server(port, model) for port in ports]
    try:
        for url in urls:
            wait_ready(url)
    except BaseException:
        stop(servers)
        raise
    return urls, servers


def stop(servers: list[subprocess.Popen[bytes]]) -> None:
    for server in servers:
        server.terminate()
    for server in servers:
        server.wait(timeout=60)


def main() -> int:
    tps = [int(tp) for tp in (sys.argv[1:] or ["2", "4"])]
    spawn = mp.get_context("spawn")
    pipes = [spawn.Pipe() for _ in range(max(tps))]
    processes = [
        spawn.Process(target=rank_main, args=(rank, child), daemon=True)
        for rank, (_, child) in enumerate(pipes)
    ]
    problems: list[str] = []
    try:
        for process in processes:
            process.start()
        ranks = [parent for parent, _ in pipes]
        for conn in ranks:
            if not conn.poll(600):
                raise RuntimeError("a rank process did not start")
            conn.recv()
        number = 0
        for model_type, scenarios in DEPLOYMENTS:
            print(f"-- {model_type}", flush=True)
            urls, servers = serve_model(model_type)
            try:
                for tp in tps:
                    for scenario in scenarios:
                        problems += run_scenario(ranks, urls, tp, number, scenario)
                        number += 1
            finally:
                stop(servers)
        for conn in ranks:
            conn.send(None)
    finally:
        for process in processes:
            process.join(timeout=30)
    for problem in problems:
        print("PROBLEM", problem)
    print("all scenarios passed" if not problems else f"{len(problems)} problems")
    return 1 if problems else 0


if __name__ == "__main__":
    sys.exit(main())
