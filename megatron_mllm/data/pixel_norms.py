"""Per-channel pixel means and standard deviations images are normalised with."""

CLIP_MEAN = (0.48145466, 0.4578275, 0.40821073)  # OpenAI CLIP's (LLaVA, Qwen2-VL)
CLIP_STD = (0.26862954, 0.26130258, 0.27577711)
PLAIN_MEAN = (0.5, 0.5, 0.5)  # [0, 1] pixels to [-1, 1]
PLAIN_STD = (0.5, 0.5, 0.5)
