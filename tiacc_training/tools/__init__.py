"""Command-line tools: general_image_list, img2tfrecord, tfrecord_verify."""
