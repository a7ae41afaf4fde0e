//! Small encoded images for the engine's unit tests.

use std::io::Cursor;

/// `img` encoded in `format` by the `image` crate.
pub fn encode(img: &image::RgbImage, format: image::ImageFormat) -> Vec<u8> {
    let mut out = Cursor::new(Vec::new());
    img.write_to(&mut out, format)
        .expect("encoding into memory cannot fail");
    out.into_inner()
}

/// A `w x h` image whose pixel (x, y) is `[x, y, blue]` (wrapping).
pub fn gradient(w: u32, h: u32, blue: u8) -> image::RgbImage {
    image::RgbImage::from_fn(w, h, |x, y| image::Rgb([x as u8, y as u8, blue]))
}
