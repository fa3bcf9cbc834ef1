//! A vision model's placeholder expansion: how many prompt tokens an image becomes.
//!
//! A chat template renders each image as one placeholder token (Qwen2-VL's `<|image_pad|>`,
//! LLaVA's `<image>`); the engine's multimodal processor then replaces it by as many copies as
//! the image has embeddings, and keys the blocks over that run by the image's identifier (see
//! `infera_core::hashing::identity`). The router repeats the expansion to hash the prompt the
//! engine caches. Supported, as vLLM 0.33 counts them:
//!
//! - **Qwen2-VL and Qwen2.5-VL** (`model_type` `qwen2_vl`, `qwen2_5_vl`): the image is resized
//!   by transformers' `smart_resize` to multiples of `patch_size × spatial_merge_size`, with its
//!   area clamped to the processor's `[shortest_edge, longest_edge]` pixels
//!   (`preprocessor_config.json`: `size`, or the older `min_pixels`/`max_pixels`, which win);
//!   it becomes `(h / patch) × (w / patch) / merge²` tokens
//!   (`vllm/model_executor/models/qwen2_vl.py`, `_get_vision_info`).
//! - **LLaVA 1.5** (`llava`): every image is `(image_size / patch_size)²` tokens of its CLIP
//!   tower, one more under `vision_feature_select_strategy: "full"`.
//!
//! Other model types have no profile: their images are routed by load.

use std::path::Path;

use infera_core::hashing::identity::MmRun;
use serde_json::Value;

/// How a model counts an image's tokens.
#[derive(Debug, Clone, PartialEq)]
enum Count {
    /// Qwen2-VL's dynamic resolution.
    SmartResize {
        patch: u32,
        merge: u32,
        min_pixels: u64,
        max_pixels: u64,
    },
    /// The same number for every image.
    Fixed(u32),
}

/// What the router needs to expand a vision model's image placeholders. See the module docs.
#[derive(Debug, Clone, PartialEq)]
pub struct VisionProfile {
    /// The token a template renders once per image and the engine expands.
    pub image_token: u32,
    count: Count,
    model_type: String,
}

impl VisionProfile {
    /// The profile of the model whose `config.json` and `preprocessor_config.json` lie in
    /// `dir`, with `image_token` resolving a token's text through the tokenizer's vocabulary.
    /// `None` for a model that is not a vision model, or one of a type not supported.
    ///
    /// # Errors
    /// A config that names a supported vision model but cannot be read, with what is wrong.
    pub fn from_dir(
        dir: &Path,
        token_id: impl Fn(&str) -> Option<u32>,
    ) -> Result<Option<Self>, String> {
        let read = |name: &str| -> Result<Option<Value>, String> {
            let path = dir.join(name);
            match std::fs::read(&path) {
                Ok(bytes) => serde_json::from_slice(&bytes)
                    .map(Some)
                    .map_err(|e| format!("{}: {e}", path.display())),
                Err(e) if e.kind() == std::io::ErrorKind::NotFound => Ok(None),
                Err(e) => Err(format!("{}: {e}", path.display())),
            }
        };
        let Some(config) = read("config.json")? else {
            return Ok(None);
        };
        let model_type = config["model_type"].as_str().unwrap_or_default().to_owned();
        let uint = |v: &Value| v.as_u64().and_then(|n| u32::try_from(n).ok());
        let vision = &config["vision_config"];
        let (count, token_text, ids) = match model_type.as_str() {
            "qwen2_vl" | "qwen2_5_vl" => {
                let pre = read("preprocessor_config.json")?.unwrap_or(Value::Null);
                let patch = uint(&vision["patch_size"])
                    .or_else(|| uint(&pre["patch_size"]))
                    .unwrap_or(14);
                let merge = uint(&vision["spatial_merge_size"])
                    .or_else(|| uint(&pre["merge_size"]))
                    .unwrap_or(2);
                let min_pixels = pre["min_pixels"]
                    .as_u64()
                    .or_else(|| pre["size"]["shortest_edge"].as_u64())
                    .unwrap_or(56 * 56);
                let max_pixels = pre["max_pixels"]
                    .as_u64()
                    .or_else(|| pre["size"]["longest_edge"].as_u64())
                    .unwrap_or(28 * 28 * 1280);
                if patch == 0 || merge == 0 || min_pixels > max_pixels {
                    return Err(format!(
                        "{}: patch size {patch}, merge size {merge}, pixels \
                         [{min_pixels}, {max_pixels}] cannot size an image",
                        dir.display()
                    ));
                }
                let count = Count::SmartResize {
                    patch,
                    merge,
                    min_pixels,
                    max_pixels,
                };
                (count, "<|image_pad|>", &["image_token_id"][..])
            }
            "llava" => {
                let (Some(size), Some(patch)) =
                    (uint(&vision["image_size"]), uint(&vision["patch_size"]))
                else {
                    return Err(format!(
                        "{}: a llava config needs vision_config.image_size and patch_size",
                        dir.display()
                    ));
                };
                let side = size.checked_div(patch).unwrap_or(0);
                let full = config["vision_feature_select_strategy"].as_str() == Some("full");
                let count = Count::Fixed(side * side + u32::from(full));
                (
                    count,
                    "<image>",
                    &["image_token_index", "image_token_id"][..],
                )
            }
            _ => return Ok(None),
        };
        let image_token = ids
            .iter()
            .find_map(|key| uint(&config[*key]))
            .or_else(|| token_id(token_text))
            .ok_or_else(|| {
                format!(
                    "{}: a {model_type} model whose tokenizer has no {token_text} token",
                    dir.display()
                )
            })?;
        Ok(Some(Self {
            image_token,
            count,
            model_type,
        }))
    }

    /// The model type the profile was read for.
    pub fn model_type(&self) -> &str {
        &self.model_type
    }

    /// How many tokens an image of `width × height` pixels becomes; `None` for one the engine
    /// refuses (Qwen2-VL: an aspect ratio over 200, or an empty image).
    pub fn image_tokens(&self, width: u32, height: u32) -> Option<u32> {
        match self.count {
            Count::Fixed(n) => Some(n),
            Count::SmartResize {
                patch,
                merge,
                min_pixels,
                max_pixels,
            } => {
                let (h, w) = smart_resize(height, width, patch * merge, min_pixels, max_pixels)?;
                Some((h / patch) * (w / patch) / (merge * merge))
            }
        }
    }

    /// Expands `ids`, a rendered prompt with one placeholder per image, for images of the given
    /// identifiers and sizes (in prompt order): each placeholder becomes its image's run.
    /// `None` when the placeholders and the images do not pair up, or an image has no size the
    /// engine takes.
    pub fn expand(
        &self,
        ids: &[u32],
        images: &[(Box<str>, u32, u32)],
    ) -> Option<(Vec<u32>, Vec<MmRun>)> {
        let counts = images
            .iter()
            .map(|(_, w, h)| self.image_tokens(*w, *h))
            .collect::<Option<Vec<u32>>>()?;
        let found = ids.iter().filter(|&&t| t == self.image_token).count();
        if found != images.len() {
            return None;
        }
        let extra: usize = counts.iter().map(|&n| n as usize).sum();
        let mut out = Vec::with_capacity(ids.len() + extra);
        let mut runs = Vec::with_capacity(images.len());
        let mut next = images.iter().zip(&counts);
        for &t in ids {
            if t != self.image_token {
                out.push(t);
                continue;
            }
            let ((id, _, _), &n) = next.next()?;
            runs.push(MmRun {
                offset: u32::try_from(out.len()).ok()?,
                length: n,
                id: id.clone(),
            });
            out.extend(std::iter::repeat_n(t, n as usize));
        }
        Some((out, runs))
    }
}

/// transformers' Qwen2-VL `smart_resize` (see the module docs): the `(height, width)` an image
/// is resized to, multiples of `factor` with an area in `[min_pixels, max_pixels]`. Python's
/// `round` rounds halves to even; so does this.
fn smart_resize(
    height: u32,
    width: u32,
    factor: u32,
    min_pixels: u64,
    max_pixels: u64,
) -> Option<(u32, u32)> {
    if height == 0 || width == 0 || factor == 0 {
        return None;
    }
    let (h, w, f) = (f64::from(height), f64::from(width), f64::from(factor));
    if h.max(w) / h.min(w) > 200.0 {
        return None;
    }
    let snap = |x: f64| x as u64 * u64::from(factor);
    let mut h_bar = snap((h / f).round_ties_even());
    let mut w_bar = snap((w / f).round_ties_even());
    if h_bar * w_bar > max_pixels {
        let beta = ((h * w) / max_pixels as f64).sqrt();
        h_bar = snap((h / beta / f).floor()).max(u64::from(factor));
        w_bar = snap((w / beta / f).floor()).max(u64::from(factor));
    } else if h_bar * w_bar < min_pixels {
        let beta = (min_pixels as f64 / (h * w)).sqrt();
        h_bar = snap((h * beta / f).ceil());
        w_bar = snap((w * beta / f).ceil());
    }
    Some((u32::try_from(h_bar).ok()?, u32::try_from(w_bar).ok()?))
}

#[cfg(test)]
mod tests {
    use super::*;

    fn qwen(min_pixels: u64, max_pixels: u64) -> VisionProfile {
        VisionProfile {
            image_token: 9,
            count: Count::SmartResize {
                patch: 14,
                merge: 2,
                min_pixels,
                max_pixels,
            },
            model_type: "qwen2_vl".into(),
        }
    }

    /// Counts computed by transformers' own `smart_resize` (fixtures/vision/README.md).
    #[test]
    fn qwen2_vl_counts_equal_the_engines() {
        let raw = include_str!("../../../fixtures/vision/qwen2_vl_image_tokens.json");
        let golden: Value = serde_json::from_str(raw).expect("fixture");
        let cases = golden["cases"].as_array().expect("cases");
        assert!(cases.len() > 60);
        for case in cases {
            let p = &case["profile"];
            let profile = qwen(
                p["min_pixels"].as_u64().expect("min"),
                p["max_pixels"].as_u64().expect("max"),
            );
            let (w, h) = (case["width"].as_u64(), case["height"].as_u64());
            let got = profile.image_tokens(
                u32::try_from(w.expect("w")).expect("w"),
                u32::try_from(h.expect("h")).expect("h"),
            );
            assert_eq!(
                got.map(u64::from),
                case["tokens"].as_u64(),
                "{case} (half-way sizes round to even)"
            );
        }
    }

    #[test]
    fn expansion_puts_each_images_run_where_its_placeholder_was() {
        let p = VisionProfile {
            count: Count::Fixed(3),
            ..qwen(1, 2)
        };
        let images = [("a".into(), 10, 10), ("b".into(), 10, 10)];
        let (ids, runs) = p.expand(&[1, 9, 2, 9], &images).expect("pairs up");
        assert_eq!(ids, [1, 9, 9, 9, 2, 9, 9, 9]);
        assert_eq!(
            runs,
            [
                MmRun {
                    offset: 1,
                    length: 3,
                    id: "a".into()
                },
                MmRun {
                    offset: 5,
                    length: 3,
                    id: "b".into()
                }
            ]
        );
        assert!(
            p.expand(&[1, 9, 2], &images).is_none(),
            "one placeholder short"
        );
    }

    #[test]
    fn profiles_are_read_from_the_models_configs() {
        let dir = tempfile::tempdir().expect("dir");
        let write = |name: &str, v: Value| {
            std::fs::write(dir.path().join(name), v.to_string()).expect("write");
        };
        let vocab = |t: &str| (t == "<|image_pad|>").then_some(151_655);
        assert_eq!(VisionProfile::from_dir(dir.path(), vocab), Ok(None));
        write("config.json", serde_json::json!({"model_type": "qwen2"}));
        assert_eq!(VisionProfile::from_dir(dir.path(), vocab), Ok(None));
        write(
            "config.json",
            serde_json::json!({"model_type": "qwen2_vl",
                "vision_config": {"patch_size": 14, "spatial_merge_size": 2}}),
        );
        write(
            "preprocessor_config.json",
            serde_json::json!({"size": {"shortest_edge": 3136, "longest_edge": 1_003_520},
                "max_pixels": 12_845_056}),
        );
        let p = VisionProfile::from_dir(dir.path(), vocab)
            .expect("reads")
            .expect("a vision model");
        let want = VisionProfile {
            image_token: 151_655,
            ..qwen(3136, 12_845_056)
        };
        assert_eq!(
            p, want,
            "max_pixels wins over size; the token from the vocabulary"
        );
        write(
            "config.json",
            serde_json::json!({"model_type": "llava", "image_token_index": 32000,
                "vision_config": {"image_size": 336, "patch_size": 14},
                "vision_feature_select_strategy": "default"}),
        );
        let p = VisionProfile::from_dir(dir.path(), vocab)
            .expect("reads")
            .expect("a vision model");
        assert_eq!((p.image_token, p.image_tokens(5, 7000)), (32000, Some(576)));
        write(
            "config.json",
            serde_json::json!({"model_type": "llava", "vision_config": {}}),
        );
        assert!(VisionProfile::from_dir(dir.path(), vocab).is_err());
    }
}
