"""vLLM's POST /tokenize and POST /detokenize: a prompt or a conversation as the token ids
the engine would get (a conversation's image placeholders expanded to each image's token
count, as vLLM expands them), and token ids back to text. Images and videos are fetched
and their headers read to size them; their pixels are never decoded."""

from __future__ import annotations

from api_proc.errors import BadRequest
from api_proc.protocol import (
    DetokenizeRequest,
    TokenizeChatRequest,
    TokenizeCompletionRequest,
)
from api_proc.request_body import RequestBody, body_keys
from api_proc.serving import Serving, media_layouts, parse_body


class Tokenization:
    def __init__(self, serving: Serving) -> None:
        self.serving = serving
        self.builder = serving.builder

    async def tokenize(self, body: RequestBody) -> dict:
        data = body.take()
        chat = "messages" in body_keys(data)  # vLLM tells the two forms apart so
        req = parse_body(TokenizeChatRequest if chat else TokenizeCompletionRequest, data)
        data = None
        self.serving.check_model(req.model)
        if self.serving.config.skip_tokenizer_init:
            raise BadRequest("/tokenize needs the tokenizer, and this server runs with "
                             "--skip-tokenizer-init")
        if chat:
            spec, refs = self.serving.chat_prompt_spec(req)
            add_special, want_strs = req.add_special_tokens, req.return_token_strs
            req = None  # R1
            grids, videos = [], []
            for ref in refs:  # one at a time: only its header (its size) is kept
                image_grids, video_layouts = media_layouts(
                    await self.serving.fetch_media([ref], spec.video_sampling))
                grids += image_grids
                videos += video_layouts
            ids, _ = await self.serving.chat_prompt_ids(spec, grids, videos)
            if add_special:
                ids = self._with_special_tokens(ids)
        else:
            self.builder.check_prompt_chars(len(req.prompt), "prompt")
            ids = self.builder.tokenizer.encode(
                req.prompt, add_special_tokens=req.add_special_tokens).ids
            want_strs = req.return_token_strs
        return {"count": len(ids), "max_model_len": self.builder.max_model_len, "tokens": ids,
                "token_strs": [self.builder.tokenizer.id_to_token(i) for i in ids]
                if want_strs else None}

    def _with_special_tokens(self, ids: list[int]) -> list[int]:
        """`ids` with what the tokenizer's post-processor adds around a text (Qwen's: none)."""
        empty = self.builder.tokenizer.encode("", add_special_tokens=True).ids
        return [*empty, *ids] if empty else ids

    def detokenize(self, body: RequestBody) -> dict:
        if self.serving.config.skip_tokenizer_init:
            raise BadRequest("/detokenize needs the tokenizer, and this server runs with "
                             "--skip-tokenizer-init")
        req = parse_body(DetokenizeRequest, body.take())
        self.serving.check_model(req.model)
        vocab = self.builder.vocab_size
        outside = next((t for t in req.tokens if t >= vocab), None)
        if outside is not None:
            raise BadRequest(f"Token id {outside} is out of vocabulary (vocabulary size "
                             f"{vocab})", param="tokens")
        return {"prompt": self.builder.decoder_with_specials.decode(req.tokens)}

