// The official OpenAI Node SDK against a running epd-router (started by
// tests/e2e/node_client_test.cc with a fake decode worker, and by tests/e2e/serve_test.cc against
// `epd serve` with the real workers and the nano model). Env: EPD_BASE_URL
// (http://127.0.0.1:PORT/v1), EPD_API_KEY, EPD_REAL_MODEL=1 when a real model answers (its
// completions may end early with "stop"; the fake worker reverses the prompt).
// Prints one line per check and exits non-zero on the first failure.
import assert from 'node:assert/strict';
import OpenAI from 'openai';

const client = new OpenAI({
  baseURL: process.env.EPD_BASE_URL,
  apiKey: process.env.EPD_API_KEY ?? 'none',
  maxRetries: 0,
  timeout: 20000,
});
const model = 'epd-nano';
const realModel = process.env.EPD_REAL_MODEL === '1';
const messages = [{ role: 'user', content: 'Say hello to the node client' }];

async function main() {
  const models = await client.models.list();
  const ids = [];
  for await (const m of models) ids.push(m.id);
  assert.deepEqual(ids, [model]);
  console.log('ok models.list', ids);

  const done = await client.chat.completions.create({ model, messages, max_tokens: 24 });
  assert.equal(done.object, 'chat.completion');
  const text = done.choices[0].message.content;
  assert.equal(typeof text, 'string');
  const n = done.usage.completion_tokens;
  if (realModel) {
    assert.ok(['length', 'stop'].includes(done.choices[0].finish_reason));
    assert.ok(n > 0 && n <= 24, `completion_tokens ${n}`);
    assert.equal(n === 24, done.choices[0].finish_reason === 'length');
  } else {
    assert.equal(done.choices[0].finish_reason, 'length');
    assert.equal(n, 24);
  }
  assert.equal(done.usage.total_tokens, done.usage.prompt_tokens + n);
  assert.equal(done.usage.prompt_tokens_details.cached_tokens, 0);
  console.log('ok chat.completions.create', JSON.stringify(text));

  const stream = await client.chat.completions.create({
    model, messages, max_tokens: 24, stream: true, stream_options: { include_usage: true },
  });
  let streamed = '';
  let finish = null;
  let usage = null;
  for await (const chunk of stream) {
    if (chunk.usage) usage = chunk.usage;
    for (const c of chunk.choices) {
      streamed += c.delta?.content ?? '';
      if (c.finish_reason) finish = c.finish_reason;
    }
  }
  assert.equal(streamed, text, 'streaming and non-streaming differ');
  assert.equal(finish, done.choices[0].finish_reason);
  assert.deepEqual(usage, done.usage);
  console.log('ok chat stream', JSON.stringify(streamed));

  const completion = await client.completions.create({ model, prompt: 'abc', max_tokens: 3 });
  if (realModel) {
    assert.equal(typeof completion.choices[0].text, 'string');
    assert.ok(completion.usage.completion_tokens <= 3);
  } else {
    assert.equal(completion.choices[0].text, 'cba');
  }
  console.log('ok completions.create');

  try {
    await client.chat.completions.create({ model, messages, max_tokens: 1_000_000 });
    assert.fail('an over-limit max_tokens was accepted');
  } catch (e) {
    assert.ok(e instanceof OpenAI.BadRequestError, `expected BadRequestError, got ${e}`);
    assert.equal(e.status, 400);
    assert.equal(e.code, 'max_tokens_exceeded');
    assert.equal(e.param, 'max_tokens');
    assert.equal(e.type, 'invalid_request_error');
    assert.match(e.message, /max_tokens/);
    console.log('ok bad request ->', e.status, e.code, e.param);
  }
  try {
    await client.chat.completions.create({ model: 'no-such-model', messages });
    assert.fail('an unknown model was accepted');
  } catch (e) {
    assert.ok(e instanceof OpenAI.NotFoundError, `expected NotFoundError, got ${e}`);
    assert.equal(e.code, 'model_not_found');
    console.log('ok unknown model ->', e.status, e.code);
  }
  try {
    await new OpenAI({ baseURL: process.env.EPD_BASE_URL, apiKey: 'wrong', maxRetries: 0 })
      .models.list();
    if (process.env.EPD_API_KEY) assert.fail('a wrong API key was accepted');
  } catch (e) {
    assert.ok(e instanceof OpenAI.AuthenticationError, `expected AuthenticationError, got ${e}`);
    console.log('ok wrong key ->', e.status, e.code);
  }
  // The router still serves after the errors.
  const again = await client.chat.completions.create({ model, messages, max_tokens: 2 });
  assert.ok(again.usage.completion_tokens >= 1 && again.usage.completion_tokens <= 2);
  if (!realModel) assert.equal(again.usage.completion_tokens, 2);
  console.log('ALL OK');
}

main().catch((e) => {
  console.error('FAILED:', e);
  process.exit(1);
});
