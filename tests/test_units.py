import math

import pytest

from kvsim.errors import KvsimError
from kvsim.units import parse_bandwidth, parse_duration, parse_flops, parse_price_per_hour, parse_size


@pytest.mark.parametrize(
    "text,expected",
    [("80GiB", 80 * 2**30), ("2TiB", 2 * 2**40), ("80GB", 80e9), ("512 MiB", 512 * 2**20), (1024, 1024)],
)
def test_sizes(text, expected):
    assert parse_size(text) == expected


def test_bandwidth_and_bits():
    assert parse_bandwidth("3.35TB/s") == 3.35e12
    assert parse_bandwidth("64GB/s") == 64e9
    assert parse_bandwidth("400Gb/s") == 50e9


def test_durations_and_prices():
    assert parse_duration("2ms") == pytest.approx(0.002)
    assert parse_duration("2s") == 2.0
    assert parse_duration("100us") == pytest.approx(1e-4)
    assert parse_price_per_hour("$2.49/h") == 2.49
    assert parse_flops("989TFLOP/s") == 989e12


@pytest.mark.parametrize("bad", [-3, 0, math.nan, math.inf, "abc", "5XB", "80 GiBs", True, None, [1]])
def test_bad_sizes(bad):
    with pytest.raises(KvsimError, match="expected a size"):
        parse_size(bad)


def test_absurd_values_rejected():
    with pytest.raises(KvsimError):
        parse_size("5000PiB")
    with pytest.raises(KvsimError):
        parse_bandwidth("5PB/s")
