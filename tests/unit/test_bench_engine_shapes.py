"""bench/engine_shapes.py refuses arms that differ in more than oneDNN's cache, and reports each
arm's second pass and mixed load against the default arm's."""

import pytest

from bench.engine_shapes import check_arms, lengths, summary

ENGINE = {"dtype": "bfloat16", "max_num_batched_tokens": 2048}


def arm(cache_env, resolved=ENGINE, pass2=(1.0, 1.0), mixed_s=10.0, output_tokens=4096):
    return {"resolved": dict(resolved), "engine_cache_env": cache_env,
            "memory": [(0, 0, 100.0), (1, 8, 150.0), (2, 8, 160.0), (3, 0, 170.0)],
            "seconds": {"1": [1.0, 1.0], "2": list(pass2)},
            "mixed": {"seconds": mixed_s, "output_tokens": output_tokens}}


def test_arms_alike_but_for_the_cache_pass():
    arms = {"default": arm([None, None], {**ENGINE, "onednn_cache": "default"}),
            "64": arm(["64", "64"], {**ENGINE, "onednn_cache": "64"})}
    assert check_arms(arms) == ENGINE


@pytest.mark.parametrize("arms, complaint", [
    ({"default": arm([None]), "64": arm([None])}, "arm 64"),                 # the setting never reached the engine
    ({"default": arm(["1024"]), "64": arm(["64"])}, "arm default"),          # a capacity left over in the environment
    ({"64": arm(["64", None])}, "arm 64"),                                   # one of its processes without it
    ({"default": arm([None]), "64": arm(["64"], {**ENGINE, "dtype": "float32"})}, "engines differ"),
    ({"default": arm([None]), "64": arm(["64"], output_tokens=4000)}, "different numbers of tokens"),
])
def test_arms_that_differ_are_refused(arms, complaint):
    with pytest.raises(SystemExit, match=complaint):
        check_arms(arms)


def test_second_pass_is_compared_with_the_default_arm():
    table = summary({"default": arm([None], pass2=(1.0, 1.0)), "64": arm(["64"], pass2=(1.0, 1.2), mixed_s=10.5)})
    assert table["64"]["pass2_vs_default"] == pytest.approx(1.1)
    assert table["64"]["mixed_vs_default"] == pytest.approx(1.05)
    assert table["64"]["after_mixed_mib"] == 170.0
    assert table["default"]["pass2_vs_default"] == 1.0
    assert table["64"]["start_mib"] == 100.0 and table["64"]["after_pass1_mib"] == 150.0
    assert table["64"]["after_pass2_mib"] == 160.0


def test_lengths_walk_every_stride_th_prompt_length():
    assert lengths(10, 4) == [1, 5, 9]
    assert lengths(3, 1) == [1, 2, 3]
