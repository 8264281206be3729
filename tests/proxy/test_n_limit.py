"""N above every decoder's --max-num-seqs is a 400 naming it, before any media is fetched."""
from __future__ import annotations

from types import SimpleNamespace
from typing import Any

import pytest

from epd_common.errors import APIError
from proxy.choices import check_n


def decoders(*limits: Any) -> list[Any]:
    return [SimpleNamespace(info={} if m is None else {"max_num_seqs": m}) for m in limits]


def test_n_above_the_largest_max_num_seqs_is_a_400_naming_it() -> None:
    with pytest.raises(APIError) as err:
        check_n(33, decoders(8, 32))
    assert err.value.status == 400 and err.value.param == "n" and "--max-num-seqs (32)" in err.value.message


@pytest.mark.parametrize("n,limits", [(32, (8, 32)), (None, (1,)), (5, ()), (5, (None,)), (5, (True,))])
def test_what_some_decoder_can_run_or_none_says_passes(n: int | None, limits: tuple[Any, ...]) -> None:
    check_n(n, decoders(*limits))
