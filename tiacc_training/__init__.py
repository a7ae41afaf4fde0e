"""tiacc-training: PyTorch training acceleration with a Rust engine.

* ``tiacc_training.tfrecord``: TFRecord files and ``tf.train.Example`` records.
* ``tiacc_training.tools``: ``general_image_list``, ``img2tfrecord`` and
  ``tfrecord_verify``, the command-line tools that pack image folders.
* ``tiacc_training.errors``: the exception hierarchy.
"""

from tiacc_training._engine import __version__

__all__ = ["__version__"]
