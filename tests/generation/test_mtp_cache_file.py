"""``--prompt-cache-file`` with ``--mtp``: the head's own KV cache kept in the same file
(cache/prompt_file.py, ``MTP.head_state`` / ``MTP.restore_head_state``).

Derivation: turn 2 read back from the file runs the head over the same pairs as the same two
turns in one process with ``MTP(keep_cache=True)`` (the file holds the head's arrays, its pairs'
tokens and where they start; ``resume`` trims them as it trims a kept cache), so it drafts and
accepts exactly the same tokens. The head used here is the wired one of test_mtp.py with its
attention switched back on (a random ``o_proj``): its output then depends on the pairs it has
seen, and averaging over the whole prefix's pairs perturbs it less than over the few a head
started at the prefill sees, so it accepts more than a head that starts cold (the behaviour
before the fix; the count is this head's, not a bound). A file written without ``--mtp``, or
for another head, loads as before: the same tokens, the cold head's count.
"""

import mlx.core as mx
import pytest
from click.testing import CliRunner
from test_mtp import PROMPT, random_head, wired_head  # noqa: F401 (fixtures)

from mlxinfer.cache.kv import KVCache
from mlxinfer.cache.prompt import (
    PromptCache,
    cache_from,
    read_cache_file,
    save_cache,
    user_metadata,
)
from mlxinfer.cache.prompt_file import HEAD_SECTION, open_cache, save
from mlxinfer.cli.main import cli
from mlxinfer.generation import generate_step
from mlxinfer.generation.mtp_drafts import MTP
from mlxinfer.generation.speculative import speculative_generate_step
from mlxinfer.loading.loader import load_model

N = 16


@pytest.fixture(scope="module")
def attending(wired_head):  # noqa: F811 (the fixture imported above)
    """The wired head's model, loaded again, its head's attention output a random projection."""
    model = load_model(wired_head[0])[0]
    set_head_attention(model, seed=0)
    return model


def set_head_attention(model, seed: int) -> None:
    attention = model.model.mtp_layers[0].self_attn
    mx.random.seed(seed)
    attention.o_proj.weight = mx.random.normal(attention.o_proj.weight.shape) * 0.2


def turn(model, draft, prompt, pc) -> tuple[list[int], int]:
    """(the tokens, the drafts accepted) of one greedy turn with two drafts a step."""
    steps = list(
        speculative_generate_step(prompt, model, draft, max_tokens=N, num_draft=2, prompt_cache=pc)
    )
    return [s[0] for s in steps], sum(s[5] for s in steps)


def file_turn(model, path, prompt, *, restore=True, write_head=True, log=None):
    """One run of ``generate --prompt-cache-file path --mtp``: open, one turn, save."""
    draft = MTP(keep_cache=True)
    pc, fingerprint, warning = open_cache(path, model, draft=draft if restore else None, log=log)
    assert warning is None
    out = turn(model, draft, prompt, pc)
    save(path, pc, fingerprint, model, draft if write_head else None)
    return out


def second_prompt(model) -> list[int]:
    first = [t for t, _ in generate_step(PROMPT, model, max_tokens=N)]
    return PROMPT + first + [7, 9, 11, 200, 31]


def one_process(model, prompt2) -> tuple[list[int], int]:
    draft, pc = MTP(keep_cache=True), PromptCache(model.make_cache())
    turn(model, draft, PROMPT, pc)
    return turn(model, draft, prompt2, pc)


def cold(model, prompt2) -> tuple[list[int], int]:
    """Turn 2 with the target's prefix reused and the head starting at the prefill."""
    pc = PromptCache(model.make_cache())
    turn(model, MTP(), PROMPT, pc)
    return turn(model, MTP(), prompt2, pc)


def test_turn_two_over_the_file_accepts_as_in_one_process(attending, tmp_path):
    model, path = attending, tmp_path / "session.safetensors"
    prompt2 = second_prompt(model)
    plain = [t for t, _ in generate_step(prompt2, model, max_tokens=N)]
    kept, old = one_process(model, prompt2), cold(model, prompt2)
    file_turn(model, path, PROMPT)
    _, meta = read_cache_file(path)
    assert meta[f"{HEAD_SECTION}.kinds"] == "KVCache"
    lines: list[str] = []
    via_file = file_turn(model, path, prompt2, log=lines.append)
    assert via_file[0] == kept[0] == old[0] == plain
    assert len(lines) == 1 and "pairs read back" in lines[0]
    assert via_file[1] == kept[1] > old[1]
    # The head section passed over (what a run did before): the cold head's count.
    path.unlink()
    file_turn(model, path, PROMPT)
    assert file_turn(model, path, prompt2, restore=False) == old


def test_a_file_without_the_head_or_for_another_head_loads_as_before(attending, tmp_path):
    model, path = attending, tmp_path / "session.safetensors"
    prompt2 = second_prompt(model)
    old = cold(model, prompt2)
    # Written without --mtp (no head section): the head starts cold, nothing said.
    file_turn(model, path, PROMPT, write_head=False)
    lines: list[str] = []
    assert file_turn(model, path, prompt2, log=lines.append) == old and lines == []
    # Written with another head (other attention weights, the same model files): passed over.
    path.unlink()
    set_head_attention(model, seed=1)
    try:
        file_turn(model, path, PROMPT)
    finally:
        set_head_attention(model, seed=0)
    assert file_turn(model, path, prompt2, log=lines.append) == old
    assert len(lines) == 1 and "written for another MTP head" in lines[0]


def halved(c: KVCache) -> KVCache:
    """The same pairs with half the head width: not the head's arrays."""
    out = KVCache()
    out.state = [a[..., : a.shape[-1] // 2] for a in c.state]
    return out


@pytest.mark.parametrize(
    "change, arrays, why",
    [
        ({"first": "1"}, None, "pairs"),  # a head that started past the first pair: no resume
        ({"tokens": "5,17"}, None, "pairs"),  # more pairs than the tokens say
        ({"first": "x"}, None, "invalid literal"),
        ({}, halved, "not the head's arrays"),
    ],
)
def test_a_bad_head_section_is_passed_over_in_one_line(attending, tmp_path, change, arrays, why):
    """Rewritten with bad metadata or arrays: the head starts cold, one -v line says why."""
    model, path = attending, tmp_path / "session.safetensors"
    prompt2 = second_prompt(model)
    file_turn(model, path, PROMPT)
    stored, meta = read_cache_file(path)
    [head] = cache_from(stored, meta, HEAD_SECTION)
    head = arrays(head) if arrays is not None else head
    own = {**user_metadata(meta, HEAD_SECTION), **change}
    save_cache(path, cache_from(stored, meta), user_metadata(meta), {HEAD_SECTION: ([head], own)})
    lines: list[str] = []
    assert file_turn(model, path, prompt2, log=lines.append) == cold(model, prompt2)
    assert len(lines) == 1 and "MTP head cache not used" in lines[0] and why in lines[0]


def test_cli_turn_two_reads_the_head_back(random_head, tmp_path):  # noqa: F811
    """The CLI writes the head's cache with the model's and reads it back (-v says so); the text
    is the text without --mtp, over a file written with or without it, and a run without
    --mtp reads a file that has a head section as before."""
    path, cache = random_head[0], tmp_path / "session.safetensors"
    base = ["generate", "-m", str(path), "-n", "8", "--no-chat-template"]
    base += ["--prompt-cache-file", str(cache)]
    prompts = ("Hello world", "Hello world, again")

    def two_turns(first: list[str], second: list[str]):
        cache.unlink(missing_ok=True)
        one = CliRunner().invoke(cli, base + ["-p", prompts[0]] + first)
        two = CliRunner().invoke(cli, base + ["-p", prompts[1], "-v"] + second)
        assert one.exit_code == 0 and two.exit_code == 0, one.stderr + two.stderr
        return one.stdout + two.stdout, two.stderr

    plain, _ = two_turns([], [])
    text, said = two_turns(["--mtp"], ["--mtp"])
    assert text == plain and "MTP head cache:" in said and "pairs read back" in said
    text, said = two_turns([], ["--mtp"])  # no head section: nothing to read back
    assert text == plain and "MTP head cache" not in said
    text, said = two_turns(["--mtp"], [])  # a head section, no --mtp: not looked at
    assert text == plain and "MTP head cache" not in said
