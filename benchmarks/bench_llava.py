"""LLaVA benchmark: several questions per image (llava-bench style, the paper's workload) and video Q&A.

    python3 benchmarks/bench_llava.py [--model tiny | HF_DIR] [--images 4] [--questions 8] [--device cpu]

Systems side by side in one run: sgnb (all questions submitted at once: the radix cache prefills each image once
and the encoder cache encodes it once), sgnb with the radix cache off, and HF transformers `generate` one question
at a time (the paper's baseline). Every question is "<image> question" with greedy decoding of --new-tokens
tokens (ignore_eos). Reports questions/s, images/s and video frames/s, cache hit rate, and the ratios; writes
JSON to benchmarks/results/<date>-<device>-llava.json. `--model tiny` builds tiny random checkpoints (the
test fixtures' builder) for a CPU smoke figure; on a GPU pass a llava-hf checkpoint directory (random weights:
or `dummy:llava-1.5-7b` / `dummy:llava-next-video-7b`, whose random weights HF builds from the same config too;
their outputs are noise and do not agree: speed only). GPU, 7B shapes:
    python3 benchmarks/bench_llava.py --model dummy:llava-1.5-7b --device cuda --tokenizer DIR --quantization auto
"""

from __future__ import annotations

import argparse
import importlib.util
import json
import sys
import tempfile
import time
from pathlib import Path

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE))


def _fixtures():
    spec = importlib.util.spec_from_file_location("llava_fixtures", HERE.parent / "tests" / "llava_fixtures.py")
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    sys.modules["llava_fixtures"] = module
    spec.loader.exec_module(module)
    return module


def workload(n_images: int, n_questions: int, fx, model: str, tokenizer: str | None) -> tuple[list, list, dict]:
    """Images, and per question its prompt token ids (the image token first); video questions likewise.
    A real checkpoint's tokenizer makes the ids; a dummy model (random weights of a real shape, whose
    vocabulary need not fit any tokenizer here) gets random ids of a real question's length."""
    import numpy as np

    from sgnb.engine.model_loader import load_tokenizer, resolve_model

    source = resolve_model(model)
    vs = source.config.vision
    images = [fx.smooth_image(48 + 8 * i, 40 + 4 * i, seed=i) for i in range(n_images)]
    topics = ["the colors", "the main shape", "the lighting", "the texture", "what is in the corner",
              "the mood", "the background", "anything unusual", "the symmetry", "the brightest part"]
    texts = [f"Describe {topics[q % len(topics)]} of this picture in one sentence." for q in range(n_questions)]
    vtexts = [f"What happens in frame {k + 1}?" for k in range(4)]
    if source.dummy:
        rng = np.random.default_rng(0)
        encode = lambda t: rng.integers(100, min(source.config.vocab_size, 32000), 12).tolist()  # noqa: E731
    else:
        tok = load_tokenizer(source, tokenizer_path=tokenizer)
        encode = lambda t: tok.encode("\n" + t)  # noqa: E731
    questions = [[vs.image_token_index, *encode(t)] for t in texts]
    video_qs = [[vs.video_token_index, *encode(t)] for t in vtexts] if vs.video_token_index is not None else []
    return images, questions, {"video_questions": video_qs}


def run_sgnb(model: str, device: str, images, questions, new_tokens: int, radix: bool,
             quantization: str = "none", tokenizer: str | None = None, video_frames: int | None = None) -> dict:
    """All questions about all items submitted at once. Items are images, or (with video_frames) video paths
    sampled at that many frames."""
    from sgnb.engine import Engine

    eng = Engine(model, device=device, disable_radix_cache=not radix, quantization=quantization,
                 tokenizer_path=tokenizer)
    try:
        sp = {"max_new_tokens": new_tokens, "temperature": 0, "ignore_eos": True}

        def media(items: list) -> dict:
            return ({"video_data": [(v, video_frames) for v in items]} if video_frames
                    else {"image_data": items})

        prompts = [q for _ in images for q in questions]
        data = [img for img in images for _ in questions]
        # the whole workload once untimed: on a GPU each new shape compiles Triton specializations (a cached
        # prefix ending inside an image, a batch size) that no system should be charged with
        eng.generate(input_ids=prompts, sampling_params={**sp, "max_new_tokens": 2}, **media(data))
        eng.flush_cache()  # warmed up; the encoder cache starts empty too
        eng.scheduler.encoder_cache = type(eng.scheduler.encoder_cache)(eng.scheduler.encoder_cache.max_bytes)
        encoded0 = eng.scheduler.counters.encoded_items
        c0 = dict(eng.get_stats())
        t0 = time.perf_counter()
        outs = eng.generate(input_ids=prompts, sampling_params=sp, **media(data))
        wall = time.perf_counter() - t0
        c1 = eng.get_stats()
        return {**_rates(len(prompts), len(images), wall, video_frames),
                "cache_hit_rate": round((c1["cached_tokens"] - c0["cached_tokens"])
                                        / max(c1["prompt_tokens"] - c0["prompt_tokens"], 1), 4),
                "vision_passes": eng.scheduler.counters.encoded_items - encoded0,
                "output_ids": [o["output_ids"] for o in outs]}
    finally:
        eng.shutdown()
        del eng
        _release(device)


def _release(device: str) -> None:
    """Give a finished system's GPU memory back before the next one loads its 7B weights."""
    import gc

    import torch

    gc.collect()
    if device.startswith("cuda"):
        torch.cuda.empty_cache()


def run_hf(model_dir: str, device: str, images, questions, new_tokens: int, fx,
           video_frames: int | None = None) -> dict:
    """HF transformers generate, one question at a time, on the same checkpoint (or, for a dummy model, HF's own
    random weights of the same shape) and the same pixel values; each question preprocesses its image (or
    decodes and samples its video) again, as a stateless caller does."""
    import torch

    from sgnb.engine.model_loader import resolve_model
    from sgnb.engine.multimodal import MultimodalProcessor

    source = resolve_model(model_dir)
    kind = source.config.vision.kind
    dtype = torch.bfloat16 if device != "cpu" else torch.float32
    if source.dummy:  # random weights of the same shape, made by HF itself: a speed baseline
        import transformers

        cfg_cls = {"llava": transformers.LlavaConfig, "llava_next": transformers.LlavaNextConfig,
                   "llava_next_video": transformers.LlavaNextVideoConfig}[kind]
        with torch.device(device):
            hf = fx.hf_model_class(kind)._from_config(cfg_cls(**source.config.to_hf_dict()), torch_dtype=dtype).eval()
    else:
        hf = fx.hf_model_class(kind).from_pretrained(model_dir, torch_dtype=dtype).to(device).eval()
    proc = MultimodalProcessor(source)
    vs = source.config.vision
    media_id = vs.video_token_index if video_frames else vs.image_token_index

    def one(item_data, q: list[int], warm: bool = False) -> list[int]:
        item = proc.video(item_data, video_frames) if video_frames else proc.image(item_data)
        ids = []
        for t in q:
            ids.extend([t] * item.num_tokens if t == media_id else [t])
        inputs = {"input_ids": torch.tensor([ids], device=device)}
        if video_frames:
            inputs["pixel_values_videos"] = item.pixel_values[None].to(device, dtype)
        else:
            inputs["pixel_values"] = (item.pixel_values if kind == "llava" else item.pixel_values[None]).to(device, dtype)
            if kind != "llava":
                inputs["image_sizes"] = torch.tensor([item.extra["image_size"]], device=device)
        n = 1 if warm else new_tokens
        with torch.no_grad():
            gen = hf.generate(**inputs, max_new_tokens=n, min_new_tokens=n, do_sample=False)
        return gen[0, len(ids):].tolist()

    one(images[0], questions[0], warm=True)  # first-call costs (kernels, allocator) outside the timing
    outs = []
    t0 = time.perf_counter()
    for img in images:
        for q in questions:
            outs.append(one(img, q))
    wall = time.perf_counter() - t0
    return {**_rates(len(images) * len(questions), len(images), wall, video_frames), "output_ids": outs}


def _rates(questions: int, items: int, wall: float, video_frames: int | None) -> dict:
    """A system's counts and rates: questions/s, images/s or videos/s, and frames/s for videos."""
    row = {"questions": questions, "seconds": round(wall, 3), "questions_per_s": round(questions / wall, 3),
           ("videos_per_s" if video_frames else "images_per_s"): round(items / wall, 3)}
    if video_frames:
        row["frames_per_s"] = round(items * video_frames / wall, 2)
    return row


def _ratios(rows: dict) -> dict:
    base = rows["sgnb"]["questions_per_s"]
    return {"sgnb_vs_hf": round(base / rows["hf-transformers"]["questions_per_s"], 2),
            "radix_on_vs_off": round(base / rows["sgnb-no-radix"]["questions_per_s"], 2)}


def _agreement(rows: dict) -> str:
    agree = sum(a == b for a, b in zip(rows["sgnb"]["output_ids"], rows["hf-transformers"]["output_ids"]))
    for r in rows.values():
        r.pop("output_ids", None)
    return f"{agree}/{rows['sgnb']['questions']} (bitwise-identical arithmetic is not expected: near-ties may differ)"


def main() -> int:
    ap = argparse.ArgumentParser()
    ap.add_argument("--model", default="tiny",
                    help="'tiny' (random tiny checkpoints), an HF llava dir, or dummy:llava-1.5-7b (random weights "
                         "on both sides; with --tokenizer for the text)")
    ap.add_argument("--tokenizer", default=None, help="tokenizer dir (tokenizer_path) for a dummy model")
    ap.add_argument("--kind", default="llava_next", choices=["llava", "llava_next"], help="with --model tiny")
    ap.add_argument("--device", default="cpu")
    ap.add_argument("--images", type=int, default=4)
    ap.add_argument("--questions", type=int, default=8)
    ap.add_argument("--new-tokens", type=int, default=16)
    ap.add_argument("--frames", type=int, default=8)
    ap.add_argument("--videos", type=int, default=2, help="videos, 4 questions each (0: none)")
    ap.add_argument("--quantization", default="none",
                    help="sgnb's weights (none: the same fp32 arithmetic as HF, so greedy outputs can agree)")
    ap.add_argument("--out", default=None)
    args = ap.parse_args()

    from common import RESULTS, commit, device_name

    fx = _fixtures()
    tmp = tempfile.mkdtemp(prefix="bench-llava-")
    model = str(fx.make_llava(Path(tmp), args.kind)) if args.model == "tiny" else args.model
    video_model = str(fx.make_llava(Path(tmp), "llava_next_video")) if args.model == "tiny" else None
    if video_model is None and "video" in model:
        video_model = model
    q = args.quantization
    result = {
        "benchmark": "llava (several questions per image; several questions per video)",
        "date": time.strftime("%Y-%m-%d"), "device": device_name(), "commit": commit(), "model": args.model,
        "kind": args.kind, "quantization": args.quantization, "new_tokens": args.new_tokens,
        "target": "GPU, 7B shapes: >= 5x HF generate per question (the paper: up to 6x)",
    }
    if args.images:  # --images 0: the video part alone (a video checkpoint)
        images, questions, _ = workload(args.images, args.questions, fx, model, args.tokenizer)
        rows = {
            "sgnb": run_sgnb(model, args.device, images, questions, args.new_tokens, True, q, args.tokenizer),
            "sgnb-no-radix": run_sgnb(model, args.device, images, questions, args.new_tokens, False, q,
                                      args.tokenizer),
            "hf-transformers": run_hf(model, args.device, images, questions, args.new_tokens, fx),
        }
        _release(args.device)  # HF's model, before the next system loads its weights
        result.update({"images": args.images, "questions_per_image": args.questions, "systems": rows,
                       "ratios": _ratios(rows), "greedy_outputs_equal_to_hf": _agreement(rows)})
    if video_model and args.videos:
        videos = [str(fx.write_video(Path(tmp) / f"clip{i}.mp4", frames=24, h=48 + 8 * i, w=64))
                  for i in range(args.videos)]
        _, _, vextra = workload(1, 1, fx, video_model, args.tokenizer)
        vq = vextra["video_questions"]
        f = args.frames
        vrows = {
            "sgnb": run_sgnb(video_model, args.device, videos, vq, args.new_tokens, True, q, args.tokenizer, f),
            "sgnb-no-radix": run_sgnb(video_model, args.device, videos, vq, args.new_tokens, False, q,
                                      args.tokenizer, f),
            "hf-transformers": run_hf(video_model, args.device, videos, vq, args.new_tokens, fx, f),
        }
        _release(args.device)
        result["video"] = {"model": video_model if args.model != "tiny" else "tiny llava_next_video",
                           "videos": args.videos, "questions_per_video": len(vq), "frames": f, "systems": vrows,
                           "ratios": _ratios(vrows), "greedy_outputs_equal_to_hf": _agreement(vrows)}
    text = json.dumps(result, indent=1)
    path = Path(args.out) if args.out else RESULTS / f"{result['date']}-{args.device}-llava.json"
    path.write_text(text + "\n")
    print(text)
    return 0


if __name__ == "__main__":
    sys.exit(main())
