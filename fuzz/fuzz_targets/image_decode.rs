//! Untrusted bytes into the image code: header probing (our own JPEG
//! segment walker and PNG IHDR reader) and decoding (libjpeg-turbo through
//! our FFI wrapper, the `image` crate otherwise), full and cropped.
#![no_main]

use std::path::Path;

use libfuzzer_sys::fuzz_target;
use tiacc_core::image::decode::{decode_rgb, decode_rgb_scaled};
use tiacc_core::image::fused::{render, Geometry, Output, OutputSlice};
use tiacc_core::image::probe::probe_image;

fuzz_target!(|data: &[u8]| {
    let Ok(info) = probe_image(data, Path::new("fuzz")) else {
        return;
    };
    // Stay clear of legitimately huge images: the fuzzer's memory limit is
    // not what is being tested.
    if u64::from(info.width) * u64::from(info.height) > 1 << 22 {
        return;
    }
    if let Ok(img) = decode_rgb(data) {
        assert_eq!(img.pixels.len(), img.width * img.height * 3);
        for denom in [2, 8] {
            if let Ok(small) = decode_rgb_scaled(data, denom) {
                assert_eq!(small.pixels.len(), small.width * small.height * 3);
            }
        }
        let (w, h) = (img.width as u32, img.height as u32);
        let g = Geometry {
            crop: (w / 4, h / 3, (w / 2).max(1), (h / 2).max(1)),
            resize: (7, 5),
            window: (-1, 0, 8, 5),
            flip: true,
        };
        let mut out = vec![0u8; 3 * 8 * 5];
        let _ = render(data, &g, true, Output::Uint8, OutputSlice::Uint8(&mut out));
    }
});
