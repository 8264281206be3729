"""Block keys name everything a block's K/V depends on, and nothing a client can fake."""
from __future__ import annotations

from decoder_service.engine.prefix_hash import prompt_chain

IMG = 99  # the image token id
B = 4


def test_keys_follow_the_tokens_the_pictures_and_the_salt() -> None:
    ids = [1, 2, 3, 4, 5, IMG, IMG, IMG, IMG, 6, 7, 8, 9]  # blocks: [1..4] [5 I I I] [I 6 7 8] + tail [9]
    red = prompt_chain(ids, B, "", IMG, [("red", 4)])
    blue = prompt_chain(ids, B, "", IMG, [("blue", 4)])
    salted = prompt_chain(ids, B, "tenant", IMG, [("red", 4)])
    fake = prompt_chain(ids, B, "", IMG)  # the same ids typed as text (a completions prompt): no image named
    assert red is not None and blue is not None and salted is not None and fake is not None
    assert len(red.keys) == 3 and red.tail == (9,)
    assert red.keys[0] == blue.keys[0] == fake.keys[0]  # the text before the image is shared
    assert len({red.keys[1], blue.keys[1], fake.keys[1]}) == 3  # from the image on, never
    assert not set(salted.keys) & set(red.keys)


def test_which_image_rows_a_block_holds_is_part_of_its_key() -> None:
    """Two images whose rows split differently over the same ids (2 + 3 vs 3 + 2 rows) differ in every block after
    the split, even with the same two mm_hashes."""
    ids = [1, IMG, IMG, IMG, IMG, IMG, 2, 3]
    a = prompt_chain(ids, B, "", IMG, [("x", 2), ("y", 3)])
    b = prompt_chain(ids, B, "", IMG, [("x", 3), ("y", 2)])
    assert a is not None and b is not None and a.keys[0] != b.keys[0]


def test_image_rows_that_do_not_add_up_are_not_cached() -> None:
    assert prompt_chain([1, IMG, IMG, 2], B, "", IMG, [("x", 3)]) is None


def test_extending_with_generated_tokens_equals_the_longer_prompt_and_stops_at_an_image_tail() -> None:
    prompt, generated = [1, 2, 3, 4, 5, 6], [7, 8, 9, 10, 11]
    chain = prompt_chain(prompt, B)
    longer = prompt_chain(prompt + generated, B)
    assert chain is not None and longer is not None
    assert chain.extend(generated) == longer.keys and chain.extend([]) == chain.keys
    tail_image = prompt_chain([1, 2, 3, 4, IMG], B, "", IMG, [("x", 1)])
    assert tail_image is not None and not tail_image.extendable and tail_image.extend([5, 6, 7]) == tail_image.keys


def test_audio_rows_are_named_by_their_clip() -> None:
    """Two clips of one length write the same audio tokens: only their hashes tell their blocks apart (else one
    clip's K/V would answer the other's prompt), and a prompt whose audio rows are not counted is not cached."""
    aud = IMG + 1
    ids = [1, aud, aud, aud, aud, 2, 3, 4]
    one = prompt_chain(ids, B, "", IMG, [("clip-1", 4)], audio_token_id=aud)
    two = prompt_chain(ids, B, "", IMG, [("clip-2", 4)], audio_token_id=aud)
    assert one is not None and two is not None and one.keys[0] != two.keys[0]
    assert prompt_chain(ids, B, "", IMG, [("clip-1", 4)]) is None


def test_interleaved_kinds_name_each_token_by_its_own_item() -> None:
    """A video's sound track interleaves its rows with the video's (Qwen2.5-Omni's use_audio_in_video): with `kinds`,
    each kind's tokens take its items' rows in order, so the audio tokens between two runs of video tokens are the
    track's rows, not the video's next ones; kinds that do not add up leave the prompt uncached."""
    from decoder_service.engine.prefix_hash import _runs

    v, a = 7, 8
    ids = [1, v, v, a, v, v, a, a]
    positions = [i for i, t in enumerate(ids) if t in (v, a)]
    items = [("video", 4), ("track", 3)]
    # (first media index, item, its first row): video rows 0-1, track row 0, video rows 2-3, track rows 1-2
    assert _runs(ids, positions, items, [v, a]) == [(0, 0, 0), (2, 1, 0), (3, 0, 2), (5, 1, 1)]
    assert _runs(ids, positions, items, ()) == [(0, 0, 0), (4, 1, 0)]  # item order over all media tokens
    with_kinds = prompt_chain(ids, 2, image_token_id=5, images=items, video_token_id=v, audio_token_id=a,
                              kinds=[v, a])
    without = prompt_chain(ids, 2, image_token_id=5, images=items, video_token_id=v, audio_token_id=a)
    assert with_kinds is not None and without is not None
    assert with_kinds.keys[0] == without.keys[0] and with_kinds.keys[1] != without.keys[1]
    assert prompt_chain(ids, 2, image_token_id=5, images=[("video", 3), ("track", 4)], video_token_id=v,
                        audio_token_id=a, kinds=[v, a]) is None
