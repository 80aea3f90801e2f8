"""Training data at scale: every ShareGPT human turn with its context (held-out
conversations kept out), whole-turn truncation from the left, several responses per
prompt at several temperatures, compact token shards, exact resume and refusal to mix."""

from __future__ import annotations

import json

import numpy as np
import pytest

from dspine_jax.data.prompts import (conversation_of, fit_chat, is_held_out, jsonl_prompts,
                                     sharegpt_prompts)
from dspine_jax.data.shards import (Sequence, load_dataset, read_manifest, read_shard,
                                    token_dtype, write_manifest, write_shard)
from dspine_jax.errors import InputError
from dspine_jax.page_pool import pages_needed
from dspine_jax.runtime.offline import generate_tokens
from pallas_kernels.switches import Switches
from tests.conftest import save_hf_model, write_tiny_tokenizer


def ids_where(held: bool, count: int, prefix: str) -> list[str]:
    found = [f"{prefix}{i}" for i in range(2000) if is_held_out(f"{prefix}{i}_0") == held]
    return found[:count]


def conversation(cid: str, turns: int) -> dict:
    roles = ["human", "gpt"] * turns
    return {"id": cid, "conversations": [{"from": r, "value": f"{cid} turn {k} {r}"}
                                         for k, r in enumerate(roles)]}


def test_every_human_turn_with_its_context_and_no_turn_of_a_held_out_conversation(tmp_path):
    train_ids = ids_where(False, 3, "t")
    held_ids = ids_where(True, 2, "h")
    # A long conversation cut into segments, one of which is held out: its training-side
    # segment continues the held-out one, so it must stay out of training too.
    base = next(b for b in (f"s{i}" for i in range(2000))
                if not is_held_out(f"{b}_0") and is_held_out(f"{b}_1"))
    convs = ([conversation(f"{c}_0", 3) for c in train_ids + held_ids]
             + [conversation(f"{base}_0", 2), conversation(f"{base}_1", 2)]
             + [{"id": "x_0", "conversations": [{"from": "gpt", "value": "hi"},
                                                {"from": "human", "value": "  "},
                                                {"from": "system", "value": "sys"},
                                                {"from": "human", "value": "late"}]}])
    assert not is_held_out("x_0")
    path = tmp_path / "sharegpt.json"
    path.write_text(json.dumps(convs))

    train = sharegpt_prompts("train", path=path, turns="all")
    held = {conversation_of(f"{c}_0") for c in held_ids} | {base}
    assert not any(p["conversation"] in held for p in train)
    text = json.dumps(train)
    assert not any(c in text for c in held_ids) and base not in text
    # Every human turn of every training conversation, its context the turns before it.
    assert len(train) == 3 * 3 + 1
    p = next(p for p in train if p["id"] == f"{train_ids[0]}_0#4")
    assert [m["role"] for m in p["messages"]] == ["user", "assistant"] * 2 + ["user"]
    assert p["messages"][-1]["content"] == p["prompt"] == f"{train_ids[0]}_0 turn 4 human"
    assert p["messages"][1]["content"] == f"{train_ids[0]}_0 turn 1 gpt"
    late = next(p for p in train if p["conversation"] == "x")
    assert [m["content"] for m in late["messages"]] == ["hi", "  ", "late"]  # system dropped
    # The held-out (evaluation) split is unchanged: first human turns of held-out ids.
    assert [p["id"] for p in sharegpt_prompts("heldout", path=path)] == \
        [f"{c}_0" for c in held_ids] + [f"{base}_1"]
    first = sharegpt_prompts("train", path=path)
    assert [p["id"] for p in first] == [f"{c}_0" for c in train_ids]  # x_0's first is empty
    assert all(len(p["messages"]) == 1 for p in first)


@pytest.fixture(scope="module")
def tiny(tmp_path_factory):
    root = tmp_path_factory.mktemp("scale")
    model = root / "model"
    model.mkdir()
    save_hf_model(model, "qwen3", tie_word_embeddings=True, vocab_size=320)
    write_tiny_tokenizer(model, vocab_size=300)
    with open(root / "prompts.jsonl", "w") as f:
        for i in range(5):
            f.write(json.dumps({"messages": [
                {"role": "user", "content": "the quick brown fox " * (6 if i == 1 else 1)},
                {"role": "assistant", "content": "jumps over the lazy dog " * 4},
                {"role": "user", "content": f"hello world {i}"}]}) + "\n")
        f.write(json.dumps({"prompt": "def f(x): " * 30}) + "\n")  # too long alone
    return root


def test_fit_chat_drops_whole_turns_from_the_left(tiny):
    from dspine_jax.tokenizer import TextTokenizer

    tok = TextTokenizer.from_hf_folder(tiny / "model")
    messages = [{"role": "user", "content": "the quick brown fox " * 5},
                {"role": "assistant", "content": "jumps over"},
                {"role": "user", "content": "hello world"},
                {"role": "assistant", "content": "the lazy dog"},
                {"role": "user", "content": "def f(x):"}]
    lengths = [len(tok.encode_chat(messages[k:])) for k in (0, 2, 4)]
    assert lengths[0] > lengths[1] > lengths[2]
    assert fit_chat(tok, messages, lengths[0]) == (tok.encode_chat(messages), 0)
    # One token short of the whole chat: the first user turn and its answer go, together.
    assert fit_chat(tok, messages, lengths[0] - 1) == (tok.encode_chat(messages[2:]), 2)
    assert fit_chat(tok, messages, lengths[1] - 1) == (tok.encode_chat(messages[4:]), 4)
    assert fit_chat(tok, messages, lengths[2] - 1) is None


def test_shards_are_compact_and_old_shards_still_read(tmp_path):
    assert token_dtype(320) == "uint16" and token_dtype(65536) == "uint16"
    assert token_dtype(65537) == "uint32" and token_dtype(151_936) == "uint32"
    seqs = [Sequence(np.asarray([1, 2, 65535], np.int32), np.asarray([0, 1, 1], bool)),
            Sequence(np.asarray([7], np.int32), np.asarray([1], bool))]
    name = write_shard(tmp_path, 0, seqs, "uint16")
    with np.load(tmp_path / name) as data:
        assert data["tokens"].dtype == np.uint16
    back = read_shard(tmp_path / name)
    assert [s.tokens.tolist() for s in back] == [[1, 2, 65535], [7]]
    assert back[0].tokens.dtype == np.int32 and back[0].loss_mask.tolist() == [0, 1, 1]
    big = [Sequence(np.asarray([70_000, 3], np.int32), np.asarray([0, 1], bool))]
    with pytest.raises(InputError, match="cannot be stored as uint16"):
        write_shard(tmp_path, 1, big, "uint16")
    with np.load(tmp_path / write_shard(tmp_path, 1, big, "uint32")) as data:
        assert data["tokens"].dtype == np.uint32
    # A shard as older versions wrote it: int32 tokens, uncompressed, no token_dtype.
    with open(tmp_path / "shard-00002.npz", "wb") as f:
        np.savez(f, tokens=np.asarray([5, 6, 7], np.int32), loss_mask=np.asarray([0, 0, 1], bool),
                 offsets=np.asarray([0, 3]))
    write_manifest(tmp_path, {"settings": {}, "shards": [{"file": "shard-00002.npz"}]})
    assert [s.tokens.tolist() for s in load_dataset(tmp_path)] == [[5, 6, 7]]


def test_jsonl_messages_are_chat_context(tmp_path):
    path = tmp_path / "p.jsonl"
    path.write_text(json.dumps({"id": "a", "messages": [{"role": "user", "content": "x"},
                                                        {"role": "assistant", "content": "y"},
                                                        {"role": "user", "content": "z"}]})
                    + "\n")
    (p,) = jsonl_prompts(path)
    assert p["prompt"] == "z" and p["chat"] and len(p["messages"]) == 3
    path.write_text(json.dumps({"messages": [{"role": "user", "content": "x"},
                                             {"role": "assistant", "content": "y"}]}) + "\n")
    with pytest.raises(InputError, match="p.jsonl:1: \"messages\" must be"):
        jsonl_prompts(path)


def test_temperatures_samples_resume_and_refusal(tiny, tmp_path, monkeypatch):
    from dspine_jax.api import Pipeline
    from dspine_jax.tokenizer import TextTokenizer
    import dspine_train.regenerate as regen

    pipe = Pipeline.load(str(tiny / "model"))
    # One pipeline for every run below: its compiled programs are reused (test time).
    monkeypatch.setattr(Pipeline, "load", classmethod(lambda cls, *a, **k: pipe))
    kw = dict(target=str(tiny / "model"), source=str(tiny / "prompts.jsonl"),
              max_new_tokens=12, max_prompt_tokens=80, temperatures=[0.0, 1.0],
              samples_per_prompt=2, batch_size=4, shard_size=3)
    straight = regen.regenerate(tmp_path / "straight", **kw)
    assert straight["token_dtype"] == "uint16" and straight["settings"]["format"] == 2
    assert all(shard["seconds"] > 0 for shard in straight["shards"])  # decoding time
    with np.load(tmp_path / "straight" / "shard-00000.npz") as data:
        assert data["tokens"].dtype == np.uint16
    # 6 prompts: the long one skipped, prompt 1 loses its first two turns; 3 answers each.
    assert (straight["skipped_long_prompts"], straight["truncated_prompts"],
            straight["dropped_context_turns"]) == (1, 1, 2)
    sequences = load_dataset(tmp_path / "straight")
    assert len(sequences) == 5 * 3
    tok = TextTokenizer.from_hf_folder(tiny / "model")
    prompts = jsonl_prompts(tiny / "prompts.jsonl")
    for i in (0, 1):
        ids = fit_chat(tok, prompts[i]["messages"], 80)[0]
        assert ids == tok.encode_chat(prompts[i]["messages"][2 * i:])
        greedy, hot1, hot2 = sequences[3 * i:3 * i + 3]
        want = generate_tokens(pipe.decoder, [ids], max_new_tokens=12).generations[0].tokens
        assert greedy.tokens.tolist() == ids + want
        assert hot1.tokens[:len(ids)].tolist() == hot2.tokens[:len(ids)].tolist() == ids
        assert hot1.tokens.tolist() != hot2.tokens.tolist()  # two samples, not one twice
        assert not greedy.loss_mask[:len(ids)].any() and greedy.loss_mask[len(ids):].all()

    # Killed while writing its second shard, then rerun: the same data, shard 0 kept.
    out = tmp_path / "resumed"
    real = regen.write_shard
    calls = []

    def crash_after_first(*args):
        if calls:
            raise KeyboardInterrupt
        calls.append(1)
        return real(*args)

    monkeypatch.setattr(regen, "write_shard", crash_after_first)
    with pytest.raises(KeyboardInterrupt):
        regen.regenerate(out, **kw)
    first = (out / "shard-00000.npz").stat().st_mtime_ns
    monkeypatch.setattr(regen, "write_shard", real)
    regen.regenerate(out, **kw)
    assert (out / "shard-00000.npz").stat().st_mtime_ns == first
    assert [s.tokens.tolist() for s in load_dataset(out)] == \
        [s.tokens.tolist() for s in sequences]
    assert read_manifest(out)["skipped_long_prompts"] == 1  # counted once, not per run

    for change, names in (({"temperatures": [0.0, 0.7]}, "temperatures"),
                          ({"samples_per_prompt": 3}, "samples_per_prompt"),
                          ({"max_prompt_tokens": 64}, "max_prompt_tokens")):
        with pytest.raises(InputError, match=f"other settings \\({names}\\)"):
            regen.regenerate(out, **{**kw, **change})
    manifest = read_manifest(out)  # a folder of the older format: no "format" setting
    del manifest["settings"]["format"]
    write_manifest(out, manifest)
    with pytest.raises(InputError, match="other settings \\(format\\)"):
        regen.regenerate(out, **kw)
    with pytest.raises(InputError, match="--turns applies to ShareGPT"):
        regen.regenerate(tmp_path / "x", **{**kw, "turns": "all"})



def test_max_seconds_stops_after_a_shard_and_the_rerun_completes(tiny, tmp_path, monkeypatch):
    """A time-bounded run stops once a shard lands past max_seconds (here: the first),
    says so in its manifest, and the same command without the bound finishes the same
    data an unbounded run makes."""
    from dspine_jax.api import Pipeline
    import dspine_train.regenerate as regen

    pipe = Pipeline.load(str(tiny / "model"), serving=True)
    monkeypatch.setattr(Pipeline, "load", classmethod(lambda cls, *a, **k: pipe))
    kw = dict(target=str(tiny / "model"), source=str(tiny / "prompts.jsonl"),
              max_new_tokens=6, max_prompt_tokens=80, temperatures=[0.0, 1.0],
              batch_size=4, shard_size=2)
    whole = regen.regenerate(tmp_path / "whole", **kw)
    assert whole["complete"] and len(whole["shards"]) == 3
    part = regen.regenerate(tmp_path / "part", **kw, max_seconds=1e-9)
    assert not part["complete"] and len(part["shards"]) == 1
    assert not read_manifest(tmp_path / "part")["complete"]
    rest = regen.regenerate(tmp_path / "part", **kw)
    assert rest["complete"] and len(rest["shards"]) == 3
    assert [s.tokens.tolist() for s in load_dataset(tmp_path / "part")] == \
        [s.tokens.tolist() for s in load_dataset(tmp_path / "whole")]
    with pytest.raises(InputError, match="max_seconds"):
        regen.regenerate(tmp_path / "x", **kw, max_seconds=0)

def test_slot_engine_gives_each_response_its_own_seed(tiny, tmp_path, monkeypatch):
    """Continuous batching: a response does not depend on the responses decoded beside
    it, and T = 0 is the target's greedy answer."""
    from dspine_jax.api import Pipeline
    from dspine_jax.tokenizer import TextTokenizer
    import dspine_train.regenerate as regen

    pipe = Pipeline.load(str(tiny / "model"), serving=True)    # as regenerate loads it
    monkeypatch.setattr(Pipeline, "load", classmethod(lambda cls, *a, **k: pipe))
    kw = dict(target=str(tiny / "model"), source=str(tiny / "prompts.jsonl"),
              max_new_tokens=12, max_prompt_tokens=80, temperatures=[0.0, 1.0],
              samples_per_prompt=2, batch_size=4)
    runs = {}
    for shard in (2, 6):  # other responses beside each one (one compiled engine: test time)
        manifest = regen.regenerate(tmp_path / f"shard{shard}", shard_size=shard, **kw)
        assert manifest["settings"]["engine"] == "slots"
        assert manifest["compile_seconds"] > 0  # every call shape compiled before decoding
        runs[shard] = [s.tokens.tolist() for s in load_dataset(tmp_path / f"shard{shard}")]
    assert runs[2] == runs[6] and len(runs[2]) == 5 * 3
    from dspine_jax.runtime import slot_steps
    decode_modes = {key[1][2] for key in slot_steps.compiled(pipe.decoder)._executables
                    if key[0] == "decode"}
    assert decode_modes == {"greedy", "unfiltered"}  # no row filters: none compiled
    # A pool of one full request's pages for the 4 slots: responses are preempted and
    # recomputed from their own seeds, and the data stay the same.
    cores = []
    sized = regen.slot_engine
    monkeypatch.setattr(regen, "slot_engine", lambda *a: cores.append(sized(*a)) or cores[-1])
    regen.regenerate(tmp_path / "pool", shard_size=6, num_pages=pages_needed(92, 16), **kw)
    assert cores[0].num_pages == 6 and cores[0].max_model_len == 92
    assert cores[0].preemptions > 0
    assert [s.tokens.tolist() for s in load_dataset(tmp_path / "pool")] == runs[2]
    default = sized(pipe.decoder, 4, 80 + 12)  # every slot can hold the longest request
    assert default.num_pages == 4 * 6 and default.max_model_len == 92
    tok = TextTokenizer.from_hf_folder(tiny / "model")
    prompts = jsonl_prompts(tiny / "prompts.jsonl")
    ids = tok.encode_chat(prompts[2]["messages"])
    want = generate_tokens(pipe.decoder, [ids], max_new_tokens=12).generations[0].tokens
    assert runs[2][2 * 3] == ids + want
    assert runs[2][2 * 3 + 1] != runs[2][2 * 3 + 2]
    # a folder decoded by an older version's static batches is not mixed in
    manifest = read_manifest(tmp_path / "shard2")
    manifest["settings"]["engine"] = "batch"
    write_manifest(tmp_path / "shard2", manifest)
    with pytest.raises(InputError, match="other settings \\(engine\\)"):
        regen.regenerate(tmp_path / "shard2", shard_size=2, **kw)


def test_regeneration_warms_up_only_the_sampling_modes_its_calls_can_take(monkeypatch):
    """Greedy and plain sampled rows never filter, so the slot engine skips compiling the
    filtered decode calls (a third of the warm-up); top-p < 1 needs them."""
    import dspine_train.regenerate as regen

    assert regen.sampling_modes([0.0, 0.7, 1.0], 1.0) == ["greedy", "unfiltered"]
    assert regen.sampling_modes([0.0], 0.9) == ["greedy"]
    assert regen.sampling_modes([0.0, 1.0], 0.9) == ["greedy", "filtered"]
    with Switches(warp_unfiltered=False).active():      # no unfiltered program at all
        assert regen.sampling_modes([0.0, 1.0], 1.0) == ["greedy", "filtered"]


def test_slot_decoding_overlaps_a_shard_tail_with_the_next_shard():
    """The next shard's requests are queued once none waits, while the last responses of
    the one before still decode; shards come out whole and in order, each response under
    its own request (a fake engine: request k emits its id's digits, one per step)."""
    import types

    import dspine_train.regenerate as regen

    class Core:
        def __init__(self, slots):
            self.slots, self.waiting, self.running, self.log = slots, [], {}, []

        num_waiting = property(lambda self: len(self.waiting))

        def add_request(self, key, prompt, options):
            self.log.append((key, sorted(self.running)))
            self.waiting.append((key, [prompt[0]] * (1 + len(prompt))))

        def has_work(self):
            return bool(self.waiting or self.running)

        def step(self):
            while self.waiting and len(self.running) < self.slots:
                key, left = self.waiting.pop(0)
                self.running[key] = left
            outs = []
            for key, left in list(self.running.items()):
                token = left.pop()
                if not left:
                    del self.running[key]
                outs.append(types.SimpleNamespace(request_id=key, new_token_ids=[token],
                                                  finished=not left))
            return outs

    def chunk(start, lengths):
        encoded = [[start + i] * n for i, n in enumerate(lengths)]
        return regen.Chunk(len(lengths) + 1, encoded, [start + i for i in range(len(lengths))],
                           dict.fromkeys(regen.COUNTERS, 0))

    core = Core(slots=2)
    chunks = [chunk(0, [1, 6]), chunk(10, []), chunk(20, [2, 1])]
    progress = types.SimpleNamespace(update=lambda n: None)
    out = list(regen.decode_slots(core, chunks, [0.0, 1.0], 0, 8, 1.0, progress))
    assert [c for c, _, _ in out] == chunks
    assert out[0][1] == [[[0] * 2, [0] * 2], [[1] * 7, [1] * 7]]
    assert out[1][1] == [] and out[2][1] == [[[20] * 3] * 2, [[21] * 2] * 2]
    # chunk 20 was queued while chunk 0's long responses still ran
    assert ("20/0", ["1/0", "1/1"]) in core.log
    assert all(s >= 0 for _, _, s in out)
