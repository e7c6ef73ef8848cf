"""How an environment's observation becomes the token ids appended to a multi-turn episode (`ObservationEncoder`):
tokenized once, as it arrives, in the chat template's separators where prompts use the template."""

from __future__ import annotations

from lit_ppo.environments import TokenIds
from lit_ppo.errors import ConfigError
from lit_ppo.rollout.prompts import end_of_turn_token_ids


class ObservationEncoder:
    """Observation -> token ids, tokenized once. Without a chat template the text is tokenized as it is. With one,
    it is wrapped in the template's separators for a message of `role` after an assistant turn (found by rendering
    a probe conversation, as the template itself would write it), ending with the next assistant turn's header;
    when the policy's turn did not end with the end-of-turn token (it ran out of tokens, or stopped at a tool
    call's closing token) that token is prepended, so the context reads like a well-formed conversation."""

    PROBE_ASSISTANT, PROBE_OBSERVATION = "LITPPOASSISTANTPROBE", "LITPPOOBSERVATIONPROBE"

    def __init__(self, tokenizer, chat_template: bool, role: str = "tool"):
        self.tokenizer = tokenizer
        self.before = self.after = ""
        self.end_of_turn: list[int] = []
        if not chat_template:
            return
        messages = [
            {"role": "user", "content": "1+1="},
            {"role": "assistant", "content": self.PROBE_ASSISTANT},
            {"role": role, "content": self.PROBE_OBSERVATION},
        ]
        try:
            rendered = tokenizer.apply_chat_template(messages, tokenize=False, add_generation_prompt=True)
        except Exception as e:
            raise ConfigError(
                f"rollout.episodes.observation_role={role!r}: the chat template cannot render it ({e}); fix: use a "
                "role the template knows (tool, user)"
            ) from e
        if self.PROBE_OBSERVATION not in rendered or self.PROBE_ASSISTANT not in rendered:
            raise ConfigError(
                f"rollout.episodes.observation_role={role!r}: the chat template drops such messages; fix: use a role "
                "the template renders (tool, user)"
            )
        after_turn = rendered.split(self.PROBE_ASSISTANT, 1)[1]
        self.end_of_turn = end_of_turn_token_ids(tokenizer)
        if self.end_of_turn:
            text = tokenizer.decode(self.end_of_turn)
            if after_turn.startswith(text):  # the policy writes (and stops at) the end-of-turn token itself
                after_turn = after_turn[len(text) :]
        self.before, self.after = after_turn.split(self.PROBE_OBSERVATION, 1)

    def __call__(self, observation: str | TokenIds, turn_ids: list[int]) -> list[int]:
        if isinstance(observation, TokenIds):
            return [int(i) for i in observation]
        if not (self.before or self.after):
            return list(self.tokenizer(observation, add_special_tokens=False).input_ids)
        ids = list(self.tokenizer(self.before + observation + self.after, add_special_tokens=False).input_ids)
        if self.end_of_turn and (not turn_ids or turn_ids[-1] not in self.end_of_turn):
            ids = list(self.end_of_turn) + ids
        return ids
