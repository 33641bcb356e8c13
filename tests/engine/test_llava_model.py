"""LLaVA-family models (engine/models/llava.py) and their preprocessing (engine/multimodal.py) against transformers.

Tiny random checkpoints written by transformers (tests/llava_fixtures.py) are loaded through our loader; our model
runs without the engine through a small harness (KV cache, req_to_token table, BatchSpec -> ForwardBatch, the
torch attention backend) with the placeholder ids in input_ids and the rows of each item's placeholders taking
`model.encode(item)`. transformers' LlavaForConditionalGeneration / LlavaNext... on the same checkpoint are the
oracle: logprobs agree within 1e-4 (fp32, CPU), and the placeholder count of every item equals what HF's
processor expands the image token into (or, for videos, HF's own feature count). Never compare text.
"""

from __future__ import annotations

import base64
import io
import itertools
import json
import shutil
from pathlib import Path

import llava_fixtures as FX  # tests/llava_fixtures.py (tests/ is on sys.path: conftest)
import numpy as np
import pytest
import torch

from sgnb.engine.attention import make_attention_backend
from sgnb.engine.forward_batch import BatchSpec, ForwardBatch
from sgnb.engine.kv_pool import KVCache
from sgnb.engine.model_config import ModelConfig
from sgnb.engine.model_loader import load_state_dict, resolve_model
from sgnb.engine.models.llava import LlavaForConditionalGeneration
from sgnb.engine.models.registry import build_model
from sgnb.engine.multimodal import MMItem, MultimodalProcessor, image_token_count, video_token_count

TOL = 1e-4
CPU = torch.device("cpu")
MAX_TOKENS = 4096


RNG = np.random.default_rng(0)


_image = FX.smooth_image
_write_video = FX.write_video


# ---- fixtures -----------------------------------------------------------------------------------------------
class Loaded:
    """One tiny checkpoint: our model, our processor, transformers' model and tokenizer."""

    def __init__(self, path: Path, kind: str) -> None:
        from transformers import AutoTokenizer

        self.path, self.kind = path, kind
        self.source = resolve_model(str(path))
        self.cfg = self.source.config
        self.model = build_model(self.cfg, self.source, CPU, torch.float32, MAX_TOKENS)
        self.proc = MultimodalProcessor(self.source)
        self.hf = FX.hf_model_class(kind).from_pretrained(str(path)).eval()
        self.tok = AutoTokenizer.from_pretrained(str(path))

    def hf_processor(self):
        """HF's processor for images (LLaVA or LLaVA-NeXT; NeXT-Video's image side is NeXT's)."""
        from transformers import LlavaNextProcessor, LlavaProcessor

        cls = LlavaProcessor if self.kind == "llava" else LlavaNextProcessor
        return cls(image_processor=FX.image_processor(self.kind), tokenizer=self.tok,
                   patch_size=self.cfg.vision.patch_size,
                   vision_feature_select_strategy=self.cfg.vision.select_strategy,
                   num_additional_image_tokens=int(self.cfg.vision.has_cls))


@pytest.fixture(scope="module")
def ckpts(tmp_path_factory) -> dict[str, Path]:
    root = tmp_path_factory.mktemp("llava")
    made = {kind: FX.make_llava(root, kind) for kind in FX.KINDS}
    made["llava-full"] = FX.make_llava(root, "llava", select_strategy="full", feature_layer=[-1, 0], seed=1,
                                       name="llava-full")
    made["next-siglip"] = FX.make_llava(root, "llava_next", select_strategy="full", tower="siglip", seed=2,
                                        name="next-siglip")
    return made


@pytest.fixture(scope="module")
def loaded(ckpts) -> dict[str, Loaded]:
    kinds = {"llava-full": "llava", "next-siglip": "llava_next"}
    return {name: Loaded(path, kinds.get(name, name)) for name, path in ckpts.items()}


class Harness:
    """Our model driven as the engine does, one request at a time: `run` adds tokens after a cached prefix."""

    def __init__(self, model: LlavaForConditionalGeneration) -> None:
        cfg = model.config
        self.model = model
        self.cache = KVCache(MAX_TOKENS, cfg.num_hidden_layers, cfg.num_key_value_heads, cfg.head_dim,
                             torch.float32, CPU)
        self.req_to_token = torch.zeros(2, MAX_TOKENS, dtype=torch.int64)
        self.attn = make_attention_backend("torch", self.cache, cfg.num_attention_heads, cfg.num_key_value_heads,
                                           cfg.head_dim, CPU)
        self.length = 0  # tokens of request 0 in the cache

    def run(self, ids: list[int], items: list[MMItem] = ()) -> torch.Tensor:
        """Extend request 0 by `ids` (placeholders included, in the order of `items`); (T, vocab) float64
        logprobs of the new tokens."""
        spec = self.model.spec
        placeholder = {spec.image_token_index, spec.video_token_index}
        rows = [i for i, t in enumerate(ids) if t in placeholder]
        assert len(rows) == sum(it.num_tokens for it in items)
        embeds = torch.cat([self.model.encode(it) for it in items]) if items else None
        T = len(ids)
        slots = torch.arange(self.length + 1, self.length + T + 1)
        self.req_to_token[0, self.length : self.length + T] = slots
        bs = BatchSpec(input_ids=ids, out_cache_loc=slots, req_pool_indices=[0], prefix_lens=[self.length],
                       extend_lens=[T], mm_rows=rows or None, mm_embeds=embeds)
        fb = ForwardBatch.build(bs, self.req_to_token, CPU)
        fb.attn_backend = self.attn
        self.attn.init_forward_metadata(fb)
        self.length += T
        return self.model.compute_logits(self.model(fb)).double().log_softmax(-1)


def _hf_logprobs(hf, **inputs) -> torch.Tensor:
    with torch.no_grad():
        return hf(**inputs).logits[0].double().log_softmax(-1)


def _close(got: torch.Tensor, want: torch.Tensor, tol: float = TOL) -> None:
    assert got.shape == want.shape
    diff = (got - want).abs().max().item()
    assert diff < tol, f"max |logprob diff| {diff:.3g} >= {tol}"


def _check_against_hf_processor(m: Loaded, text: str, images: list[np.ndarray]) -> None:
    """HF's processor expands `text`; our items fill the same placeholders; logprobs equal HF's model."""
    inputs = m.hf_processor()(images=images, text=text, return_tensors="pt")
    items = [m.proc.image(img) for img in images]
    ids = inputs["input_ids"][0].tolist()
    runs = [len(list(g)) for t, g in itertools.groupby(ids) if t == FX.IMAGE_TOKEN_ID]  # HF's expansion
    assert runs == [it.num_tokens for it in items], (runs, [it.num_tokens for it in items])
    for i, it in enumerate(items):  # the same pixels HF's processor made
        views = it.pixel_values.shape[0]
        hf_pixels = inputs["pixel_values"][i : i + 1] if m.kind == "llava" else inputs["pixel_values"][i][:views]
        torch.testing.assert_close(it.pixel_values, hf_pixels, rtol=0, atol=0)
    want = _hf_logprobs(m.hf, **inputs)
    _close(Harness(m.model).run(ids, items), want)


# ---- logits against transformers ----------------------------------------------------------------------------
def test_distributions_are_peaked_and_images_matter(loaded) -> None:
    """Sanity of the oracle: the model is confident, and the image changes the text after it by a lot."""
    m = loaded["llava"]
    text = m.tok.encode(" The picture shows a", add_special_tokens=False)
    outs = []
    for seed in (1, 2):
        item = m.proc.image(_image(30, 24, seed))
        ids = text[:2] + [FX.IMAGE_TOKEN_ID] * item.num_tokens + text
        outs.append(Harness(m.model).run(ids, [item])[-len(text):])
    top = outs[0].max(-1).values
    assert top.min() > -6 and outs[0].min() < -15, (top, outs[0].min())  # uniform would be -10.8 everywhere
    shift = (outs[0] - outs[1]).abs().max(-1).values  # per position after the image
    assert shift.min() > 0.5, shift


@pytest.mark.parametrize("name", ["llava", "llava-full", "llava_next", "llava_next_video", "next-siglip"])
def test_one_image_matches_hf(loaded, name) -> None:
    _check_against_hf_processor(loaded[name], "USER: <image>\nWhat is this? ASSISTANT:", [_image(30, 22, 3)])


@pytest.mark.parametrize("name", ["llava", "llava_next"])
def test_two_images_in_one_prompt_match_hf(loaded, name) -> None:
    """Two images of different sizes: for LLaVA-NeXT (anyres) they take different numbers of tokens."""
    images = [_image(20, 41, 4), _image(37, 23, 5)]
    m = loaded[name]
    if name == "llava_next":
        counts = [image_token_count(m.cfg.vision, *img.shape[:2]) for img in images]
        assert counts[0] != counts[1], counts
    _check_against_hf_processor(m, "First <image> then <image>, compare them.", images)


def test_anyres_token_counts_equal_hf_processor(loaded) -> None:
    """Our count for many image sizes (tall, wide, tiny, square) = HF's processor's, without pixels."""
    m = loaded["llava_next"]
    sizes = [(16, 16), (1, 50), (50, 1), (17, 33), (33, 17), (64, 64), (100, 30), (30, 100), (31, 64), (64, 33)]
    want = m.hf_processor()._get_num_multimodal_tokens(image_sizes=sizes)["num_image_tokens"]
    assert [image_token_count(m.cfg.vision, h, w) for h, w in sizes] == want


def test_video_and_image_match_hf(loaded, tmp_path) -> None:
    """LLaVA-NeXT-Video: a video (pooled frames) and an image in one prompt."""
    import av
    from transformers import CLIPImageProcessorPil

    m = loaded["llava_next_video"]
    path = _write_video(tmp_path / "clip.mp4", frames=12)
    video = m.proc.video(path, num_frames=8)
    image = m.proc.image(_image(26, 40, 6))
    assert video.extra["total_frames"] == 12 and video.extra["frame_indices"] == [0, 2, 3, 5, 6, 8, 9, 11]
    assert video.num_tokens == video_token_count(m.cfg.vision, 8) == 8 * (8 // 2) ** 2

    # the frames are the decoded frames at those indices, preprocessed by the video processor's settings
    with av.open(str(path)) as c:
        decoded = [f.to_ndarray(format="rgb24") for f in c.decode(video=0)]
    settings = FX.video_processor_settings()
    ref = CLIPImageProcessorPil(**{k: settings[k] for k in ("size", "crop_size", "resample", "image_mean",
                                                            "image_std", "rescale_factor")})
    frames = [decoded[i] for i in video.extra["frame_indices"]]
    torch.testing.assert_close(video.pixel_values, ref(images=frames, return_tensors="pt")["pixel_values"])

    with torch.no_grad():  # HF's own count of video features
        hf_rows = m.hf.model.get_video_features(video.pixel_values[None]).pooler_output.flatten(0, 1).shape[0]
    assert hf_rows == video.num_tokens

    text = m.tok.encode(" Watch this and that.", add_special_tokens=False)
    ids = (text[:2] + [FX.VIDEO_TOKEN_ID] * video.num_tokens + text[2:4] + [FX.IMAGE_TOKEN_ID] * image.num_tokens
           + text[4:])
    want = _hf_logprobs(m.hf, input_ids=torch.tensor([ids]), pixel_values_videos=video.pixel_values[None],
                        pixel_values=image.pixel_values[None], image_sizes=torch.tensor([image.extra["image_size"]]))
    _close(Harness(m.model).run(ids, [video, image]), want)


def test_decode_over_cached_image_prefix(loaded) -> None:
    """Prefill text + image, extend over that cached prefix, then decode token by token: every step's logprobs
    equal HF's over the whole sequence."""
    m = loaded["llava_next"]
    item = m.proc.image(_image(40, 28, 7))
    text = m.tok.encode("Look: then answer briefly.", add_special_tokens=False)
    prefix = text[:2] + [FX.IMAGE_TOKEN_ID] * item.num_tokens + text[2:]
    h = Harness(m.model)
    got = [h.run(prefix, [item])]
    more = m.tok.encode(" Sure, it is", add_special_tokens=False)
    got.append(h.run(more))  # extend over the cached prefix (image included)
    seq = prefix + more
    for _ in range(4):  # greedy decode, one token per forward
        nxt = int(got[-1][-1].argmax())
        got.append(h.run([nxt]))
        seq.append(nxt)
    want = _hf_logprobs(m.hf, input_ids=torch.tensor([seq]), pixel_values=item.pixel_values[None],
                        image_sizes=torch.tensor([item.extra["image_size"]]))
    _close(torch.cat(got)[: len(seq)], want)


# ---- preprocessing: hashes and errors -----------------------------------------------------------------------
def test_hash_is_of_pixels_and_settings(loaded, tmp_path) -> None:
    from PIL import Image

    m = loaded["llava"]
    arr = _image(21, 34, 8)
    png = tmp_path / "a.png"
    Image.fromarray(arr).save(png)
    raw = png.read_bytes()
    forms = [str(png), png, Image.open(png), arr, raw, "data:image/png;base64," + base64.b64encode(raw).decode()]
    items = [m.proc.image(f) for f in forms]
    assert len({it.hash for it in items}) == 1
    for it in items[1:]:
        torch.testing.assert_close(it.pixel_values, items[0].pixel_values)
    assert all(it.kind == "image" and it.extra["image_size"] == (21, 34) for it in items)

    other = arr.copy()
    other[0, 0] ^= 1  # one pixel differs
    assert m.proc.image(other).hash != items[0].hash
    assert m.proc.image(arr[:, :33]).hash != items[0].hash  # same content, other size

    # RGBA: transparency composited onto white, as transformers does; the same pixels as the RGB it becomes
    rgba = np.dstack([arr, np.full(arr.shape[:2], 255, np.uint8)])
    assert m.proc.image(rgba).hash == items[0].hash

    # other preprocessing settings -> another hash (and other pixels)
    changed = tmp_path / "changed"
    shutil.copytree(m.path, changed)
    settings = json.loads((changed / "preprocessor_config.json").read_text())
    settings["image_mean"] = [0.5, 0.5, 0.5]
    (changed / "preprocessor_config.json").write_text(json.dumps(settings))
    assert MultimodalProcessor(resolve_model(str(changed))).image(arr).hash != items[0].hash

    # the thumbnail: a PNG no larger than 96 px
    big = m.proc.image(_image(300, 200, 9))
    assert big.thumbnail.startswith("data:image/png;base64,")
    thumb = Image.open(io.BytesIO(base64.b64decode(big.thumbnail.split(",", 1)[1])))
    assert max(thumb.size) <= 96 and thumb.size == (64, 96)


def test_video_hash_and_sampling(loaded, tmp_path) -> None:
    m = loaded["llava_next_video"]
    path = _write_video(tmp_path / "v.mp4", frames=5)
    a, b = m.proc.video(path, num_frames=8), m.proc.video(str(path), num_frames=8)
    assert a.hash == b.hash and a.kind == "video"
    assert a.extra["frame_indices"] == [0, 1, 1, 2, 2, 3, 3, 4]  # fewer frames than asked: repeated
    assert m.proc.video(path, num_frames=4).hash != a.hash
    other = _write_video(tmp_path / "w.mp4", frames=6)
    assert m.proc.video(other, num_frames=8).hash != a.hash


def test_image_errors(loaded, tmp_path) -> None:
    proc = loaded["llava"].proc
    with pytest.raises(ValueError, match="not fetched: no network access; pass a path, bytes or a data: URL"):
        proc.image("https://example.com/cat.png")
    with pytest.raises(ValueError, match="not a readable image"):
        proc.image(b"\x89PNG\r\n\x1a\nthis is not really a png")
    png = io.BytesIO()
    from PIL import Image

    Image.fromarray(_image(40, 40)).save(png, format="PNG")
    with pytest.raises(ValueError, match="not a readable image"):
        proc.image(png.getvalue()[:-60])  # truncated
    truncated = tmp_path / "truncated.png"
    truncated.write_bytes(png.getvalue()[:-60])
    with pytest.raises(ValueError, match="cannot be decoded"):
        proc.image(Image.open(truncated))  # opened lazily by the caller: decoding fails in image()
    with pytest.raises(ValueError, match="does not exist"):
        proc.image(str(tmp_path / "missing.png"))
    with pytest.raises(ValueError, match="is not a file"):
        proc.image(tmp_path)
    bad = tmp_path / "bad.jpg"
    bad.write_bytes(b"GIF89a garbage")
    with pytest.raises(ValueError, match="image file .*bad.jpg.* is not a readable image"):
        proc.image(bad)
    with pytest.raises(ValueError, match="base64 payload is corrupt"):
        proc.image("data:image/png;base64,@@@not-base64@@@")
    with pytest.raises(ValueError, match="uint8"):
        proc.image(np.zeros((8, 8, 3), np.float32))
    with pytest.raises(ValueError, match="cannot read an image from a list"):
        proc.image([1, 2, 3])
    with pytest.raises(ValueError, match="takes no videos"):
        proc.video(_write_video(tmp_path / "x.mp4", frames=2))


def test_video_errors(loaded, tmp_path) -> None:
    import av

    proc = loaded["llava_next_video"].proc
    with pytest.raises(ValueError, match="does not exist"):
        proc.video(tmp_path / "missing.mp4")
    not_video = tmp_path / "notes.mp4"
    not_video.write_text("just some text, no video in here\n" * 20)
    with pytest.raises(ValueError, match="not a video this engine reads"):  # sniffed, never probed
        proc.video(not_video)
    for name in ("sound.wav", "sound.mka"):  # real media files with an audio stream only
        audio = tmp_path / name
        with av.open(str(audio), "w") as c:
            s = c.add_stream("pcm_s16le", rate=8000)
            frame = av.AudioFrame.from_ndarray(np.zeros((1, 800), np.int16), format="s16", layout="mono")
            frame.sample_rate = 8000
            for packet in [*s.encode(frame), *s.encode()]:
                c.mux(packet)
    with pytest.raises(ValueError, match="not a video this engine reads"):  # WAV is no video container
        proc.video(tmp_path / "sound.wav")
    with pytest.raises(ValueError, match="has no video stream"):  # Matroska is, but this one holds audio only
        proc.video(tmp_path / "sound.mka")
    empty = _write_video(tmp_path / "empty.avi", frames=0, container="avi")  # a video stream, no frames
    with pytest.raises(ValueError, match="has no frames"):
        proc.video(empty)
    with pytest.raises(ValueError, match="num_frames"):
        proc.video(_write_video(tmp_path / "ok.mp4", frames=2), num_frames=0)


# ---- building, configs, weights -----------------------------------------------------------------------------
@pytest.mark.parametrize("name", ["tiny-llava", "tiny-llava-next", "tiny-llava-next-video"])
def test_dummy_models_build_and_encode(name, tmp_path) -> None:
    """dummy:tiny-llava* build through build_model with random weights; their processors come from the config."""
    source = resolve_model(f"dummy:{name}")
    cfg = source.config
    model = build_model(cfg, source, CPU, torch.float32, 1024)
    proc = MultimodalProcessor(source)
    items = [proc.image(_image(24, 40, 10))]
    if cfg.vision.kind == "llava_next_video":
        items.append(proc.video(_write_video(tmp_path / "v.mp4", frames=6), num_frames=4))
    ids = [5, 6]
    for it in items:
        feats = model.encode(it)
        assert feats.shape == (it.num_tokens, cfg.hidden_size) and feats.dtype == torch.float32
        assert torch.isfinite(feats).all() and feats.std() > 0
        placeholder = proc.spec.image_token_index if it.kind == "image" else proc.spec.video_token_index
        ids += [placeholder] * it.num_tokens + [7]
    logprobs = Harness(model).run(ids, items)
    assert torch.isfinite(logprobs).all()


def test_dummy_model_in_bfloat16() -> None:
    source = resolve_model("dummy:tiny-llava-next")
    model = build_model(source.config, source, CPU, torch.bfloat16, 256)
    item = MultimodalProcessor(source).image(_image(20, 20, 11))
    feats = model.encode(item)
    assert feats.dtype == torch.bfloat16 and feats.shape[0] == item.num_tokens and torch.isfinite(feats).all()


def test_config_round_trips(ckpts) -> None:
    import transformers

    hf_classes = {"llava": transformers.LlavaConfig, "llava_next": transformers.LlavaNextConfig,
                  "llava_next_video": transformers.LlavaNextVideoConfig}
    configs = [ModelConfig.from_json(p / "config.json") for p in ckpts.values()]
    configs += [resolve_model(f"dummy:{n}").config for n in ("tiny-llava", "tiny-llava-next",
                                                               "tiny-llava-next-video", "llava-1.5-7b",
                                                               "llava-next-video-7b")]
    for cfg in configs:
        d = cfg.to_hf_dict()
        assert ModelConfig.from_hf_dict(d) == cfg and hash(ModelConfig.from_hf_dict(d)) == hash(cfg)
        hf = hf_classes[cfg.architecture](**d)
        assert hf.text_config.hidden_size == cfg.hidden_size and hf.image_token_index == cfg.vision.image_token_index
        assert ModelConfig.from_hf_dict(hf.to_dict()) == cfg  # whatever form this transformers writes back
    full = ModelConfig.from_json(ckpts["llava-full"] / "config.json").vision
    assert (full.feature_layer, full.feature_layers, full.tokens_per_view) == ((-1, 0), (2, 0), 17)
    video = next(c for c in configs if c.architecture == "llava_next_video").to_hf_dict()
    with pytest.raises(ValueError, match="spatial_pool_mode 'conv' is not supported"):
        ModelConfig.from_hf_dict(video | {"spatial_pool_mode": "conv"})
    with pytest.raises(ValueError, match="unsupported vision tower 'dinov2'"):
        ModelConfig.from_hf_dict(video | {"vision_config": {"model_type": "dinov2"}})
    with pytest.raises(ValueError, match="'default' drops a class token"):
        ModelConfig.from_hf_dict(video | {"vision_config": {"model_type": "siglip_vision_model"}})


def test_7b_configs_parse() -> None:
    """The real published shapes (not built); the published llava-1.5-7b-hf config.json form (a partial
    text_config, completed with transformers' Llama defaults) gives the same config as our dummy file."""
    llava = resolve_model("dummy:llava-1.5-7b").config
    v = llava.vision
    assert (llava.architecture, llava.vocab_size, llava.hidden_size, llava.num_hidden_layers) == ("llava", 32064,
                                                                                                    4096, 32)
    assert (v.image_size, v.patch_size, v.vision_hidden_size, v.num_vision_layers) == (336, 14, 1024, 24)
    assert (v.image_token_index, v.tokens_per_view, v.feature_layers) == (32000, 576, (23,))
    assert image_token_count(v, 480, 640) == 576
    published = {
        "architectures": ["LlavaForConditionalGeneration"], "ignore_index": -100, "image_token_index": 32000,
        "model_type": "llava", "pad_token_id": 32001, "projector_hidden_act": "gelu",
        "text_config": {"_name_or_path": "lmsys/vicuna-7b-v1.5", "architectures": ["LlamaForCausalLM"],
                        "max_position_embeddings": 4096, "model_type": "llama", "rms_norm_eps": 1e-05,
                        "torch_dtype": "float16", "vocab_size": 32064},
        "tie_word_embeddings": False, "torch_dtype": "float16", "transformers_version": "4.36.0.dev0",
        "vision_config": {"hidden_size": 1024, "image_size": 336, "intermediate_size": 4096,
                          "model_type": "clip_vision_model", "num_attention_heads": 16, "num_hidden_layers": 24,
                          "patch_size": 14, "projection_dim": 768, "vocab_size": 32000},
        "vision_feature_layer": -2, "vision_feature_select_strategy": "default", "vocab_size": 32064}
    parsed = ModelConfig.from_hf_dict(published)
    text_fields = ("vocab_size", "hidden_size", "intermediate_size", "num_hidden_layers", "num_attention_heads",
                   "num_key_value_heads", "head_dim", "rms_norm_eps", "max_position_embeddings", "bos_token_id")
    assert all(getattr(parsed, f) == getattr(llava, f) for f in text_fields)
    assert (parsed.vision.image_size, parsed.vision.tokens_per_view) == (336, 576)

    video = resolve_model("dummy:llava-next-video-7b").config
    vv = video.vision
    assert (video.architecture, vv.image_token_index, vv.video_token_index) == ("llava_next_video", 32001, 32000)
    assert len(vv.image_grid_pinpoints) == 5 and video_token_count(vv, 8) == 8 * 144
    assert image_token_count(vv, 336, 672) == 576 + 24 * 49  # 1 x 2 tiles, no padding: 24 rows of 48 + newline


def test_tensor_parallel_is_refused() -> None:
    from sgnb.engine.tensor_parallel import TPGroup, shard_layout

    cfg = resolve_model("dummy:tiny-llava").config
    tp = TPGroup(shard_layout(cfg, 0, 2), process_group=object())
    with torch.device("meta"), pytest.raises(ValueError, match="tensor parallelism"):
        LlavaForConditionalGeneration(cfg, 64, tp)


def test_both_checkpoint_key_layouts(loaded) -> None:
    """transformers-5 save_pretrained's layout (language_model.model.*, vision_tower.*) and the newer one
    (model.language_model.*, model.vision_tower.vision_model.*, lm_head.weight) load to the same model."""
    m = loaded["llava_next"]
    state = load_state_dict(m.source, CPU, torch.float32)
    assert "language_model.model.embed_tokens.weight" in state and "image_newline" in state
    newer = {}
    for name, t in state.items():
        if name.startswith("language_model.model."):
            name = "model.language_model." + name[len("language_model.model."):]
        elif name == "language_model.lm_head.weight":
            name = "lm_head.weight"
        elif name.startswith("vision_tower."):
            name = "model.vision_tower.vision_model." + name[len("vision_tower."):]
        else:
            name = "model." + name
        newer[name] = t
    newer["model.vision_tower.vision_model.embeddings.position_ids"] = torch.arange(65)[None]
    with torch.device("meta"):
        model = LlavaForConditionalGeneration(m.cfg, MAX_TOKENS)
    model.load_hf_state_dict(newer, CPU, torch.float32)
    ours = dict(model.state_dict())
    for name, t in m.model.state_dict().items():
        torch.testing.assert_close(ours[name], t, rtol=0, atol=0, msg=name)
    item = m.proc.image(_image(20, 30, 12))
    torch.testing.assert_close(model.encode(item), m.model.encode(item), rtol=0, atol=0)

    with torch.device("meta"):
        model = LlavaForConditionalGeneration(m.cfg, MAX_TOKENS)
    with pytest.raises(ValueError, match="unexpected tensor 'extra.weight'"):
        model.load_hf_state_dict(dict(state) | {"extra.weight": torch.zeros(1)}, CPU, torch.float32)
    with pytest.raises(ValueError, match="lacks 1 vision tensors"):
        model.load_hf_state_dict({k: v for k, v in state.items() if k != "image_newline"}, CPU, torch.float32)
