"""pjray: train multimodal LLM judges that check the image before they believe an answer."""

__version__ = "0.1.0"
