"""The Horovod operations' other forms take their family's arguments (``_common.form_of``)."""

from __future__ import annotations

import inspect

import pytest

import tiacc_training.torch.horovod as hvd
from tiacc_training.torch.horovod._common import form_of

ALLREDUCE = ["average", "name", "op", "prescale_factor", "postscale_factor", "process_set"]
REDUCESCATTER = ["name", "op", "process_set", "prescale_factor", "postscale_factor"]
# Horovod's parameter lists, form by form (first the tensor or list of tensors).
FORMS = {
    "allreduce": ["tensor", "average", "name", "compression", *ALLREDUCE[2:]],
    "allreduce_": ["tensor", *ALLREDUCE],
    "allreduce_async": ["tensor", *ALLREDUCE],
    "allreduce_async_": ["tensor", *ALLREDUCE],
    "grouped_allreduce": ["tensors", "average", "name", "compression", *ALLREDUCE[2:]],
    "grouped_allreduce_": ["tensors", *ALLREDUCE],
    "grouped_allreduce_async": ["tensors", *ALLREDUCE],
    "grouped_allreduce_async_": ["tensors", *ALLREDUCE],
    "reducescatter": ["tensor", "name", "compression", *REDUCESCATTER[1:]],
    "reducescatter_async": ["tensor", *REDUCESCATTER],
    "grouped_reducescatter": ["tensors", "name", "compression", *REDUCESCATTER[1:]],
    "grouped_reducescatter_async": ["tensors", *REDUCESCATTER],
}


@pytest.mark.parametrize("name", sorted(FORMS))
def test_each_form_shows_horovods_parameters(name: str) -> None:
    function = getattr(hvd, name)
    assert function.__name__ == name
    assert function.__doc__
    assert list(inspect.signature(function).parameters) == FORMS[name]


def test_a_form_binds_positional_and_keyword_arguments_in_its_templates_order() -> None:
    def template(tensor: int, a: int = 1, b: int = 2) -> int:
        """The template."""
        return 0

    calls = []
    form = form_of(template, lambda *args: calls.append(args) or len(calls), "other", "Doc.", "int")
    assert form(5) == 1
    assert form(5, b=7) == 2
    assert calls == [(5, 1, 2), (5, 1, 7)]
    grouped = form_of(template, lambda *args: args, "grouped", "Doc.", "int", grouped=True)
    assert grouped(tensors=[1, 2], a=3) == ([1, 2], 3, 2)
    assert str(inspect.signature(grouped)).startswith("(tensors")
    assert (form.__name__, form.__qualname__, form.__doc__) == ("other", "other", "Doc.")


def test_a_wrong_argument_names_the_form() -> None:
    with pytest.raises(TypeError, match=r"allreduce_\(\): .*unexpected keyword argument 'bogus'"):
        hvd.allreduce_(None, bogus=1)
    with pytest.raises(TypeError, match=r"grouped_allreduce_async\(\): too many positional"):
        hvd.grouped_allreduce_async([], *range(7))
