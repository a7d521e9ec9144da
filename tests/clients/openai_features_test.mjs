// The OpenAI API features agent frameworks call (issue 15), with the official OpenAI Node SDK
// against two real clusters (router + encoder + prefill + decode processes on the nano model)
// started by tests/e2e/openai_api_test.cc: EPD_BASE_URL has DSpark on, EPD_BASE_URL_OFF has it
// off. Prints one line per check and exits non-zero on the first failure.
import assert from 'node:assert/strict';
import OpenAI from 'openai';

const opts = { apiKey: 'none', maxRetries: 0, timeout: 60000 };
const on = new OpenAI({ ...opts, baseURL: process.env.EPD_BASE_URL });
const off = new OpenAI({ ...opts, baseURL: process.env.EPD_BASE_URL_OFF });
const model = 'epd-nano';
const messages = [{ role: 'user', content: 'Tell me about logprobs' }];

// Checks one OpenAI chat logprob entry list: every top list has `top` entries, sorted by logprob
// (most likely first), the chosen token's logprob equals its entry when it is listed, and the
// listed probabilities sum to at most 1.
function checkChatLogprobs(content, top, nTokens) {
  assert.equal(content.length, nTokens, 'one logprob entry per completion token');
  for (const e of content) {
    assert.equal(typeof e.token, 'string');
    assert.ok(Array.isArray(e.bytes) && e.bytes.length > 0, 'bytes');
    assert.ok(e.logprob <= 0, `logprob ${e.logprob} > 0`);
    assert.equal(e.top_logprobs.length, top);
    let sum = 0;
    for (let i = 0; i < e.top_logprobs.length; ++i) {
      const t = e.top_logprobs[i];
      sum += Math.exp(t.logprob);
      if (i > 0) assert.ok(t.logprob <= e.top_logprobs[i - 1].logprob, 'top list not sorted');
      if (JSON.stringify(t.bytes) === JSON.stringify(e.bytes)) {
        assert.equal(t.logprob, e.logprob, 'chosen token logprob differs from its top entry');
      }
    }
    assert.ok(sum <= 1 + 1e-6, `top probabilities sum to ${sum}`);
  }
}

async function main() {
  // models.retrieve
  const m = await on.models.retrieve(model);
  assert.equal(m.id, model);
  assert.equal(m.object, 'model');
  try {
    await on.models.retrieve('no-such-model');
    assert.fail('an unknown model id was found');
  } catch (e) {
    assert.ok(e instanceof OpenAI.NotFoundError, `expected NotFoundError, got ${e}`);
    assert.equal(e.code, 'model_not_found');
    assert.equal(e.type, 'invalid_request_error');
  }
  console.log('ok models.retrieve');

  // Chat logprobs with top_logprobs 5: greedy, so the chosen token is the most likely one.
  const req = { model, messages, max_tokens: 12, temperature: 0, logprobs: true, top_logprobs: 5 };
  const a = await on.chat.completions.create(req);
  const nTok = a.usage.completion_tokens;
  assert.ok(nTok > 0);
  const content = a.choices[0].logprobs.content;
  checkChatLogprobs(content, 5, nTok);
  for (const e of content) {
    assert.equal(e.logprob, e.top_logprobs[0].logprob, 'greedy: chosen is the top entry');
    assert.deepEqual(e.bytes, e.top_logprobs[0].bytes);
  }
  const text = Buffer.from(content.flatMap((e) => e.bytes)).toString('utf8');
  assert.equal(text, a.choices[0].message.content, 'token bytes spell the content');
  console.log('ok chat logprobs top 5', nTok, 'tokens');

  // The same with DSpark off: same tokens, same values.
  const b = await off.chat.completions.create(req);
  assert.deepEqual(b.choices[0].logprobs.content, content, 'DSpark on and off differ');
  console.log('ok chat logprobs equal with DSpark on and off');

  // Streaming carries the same entries, chunk by chunk.
  const stream = await on.chat.completions.create({ ...req, stream: true });
  const streamed = [];
  for await (const chunk of stream) {
    for (const c of chunk.choices) streamed.push(...(c.logprobs?.content ?? []));
  }
  assert.deepEqual(streamed, content, 'streamed logprobs differ');
  console.log('ok chat stream logprobs');

  // logprobs without a top list; top_logprobs out of range is a 400 naming it.
  const plain = await on.chat.completions.create({ ...req, top_logprobs: 0 });
  assert.equal(plain.choices[0].logprobs.content.length, plain.usage.completion_tokens);
  assert.equal(plain.choices[0].logprobs.content[0].top_logprobs.length, 0);
  assert.equal(plain.choices[0].logprobs.content[0].logprob, content[0].logprob);
  try {
    await on.chat.completions.create({ ...req, top_logprobs: 21 });
    assert.fail('top_logprobs 21 was accepted');
  } catch (e) {
    assert.ok(e instanceof OpenAI.BadRequestError, `expected BadRequestError, got ${e}`);
    assert.equal(e.param, 'top_logprobs');
  }
  console.log('ok logprobs without top list, top_logprobs 21 refused');

  // Completions: logprobs = 3, streaming and not, equal with DSpark off.
  const creq = { model, prompt: 'The logprobs of', max_tokens: 8, temperature: 0, logprobs: 3 };
  const c1 = await on.completions.create(creq);
  const lp = c1.choices[0].logprobs;
  assert.equal(lp.tokens.length, c1.usage.completion_tokens);
  assert.equal(lp.token_logprobs.length, lp.tokens.length);
  assert.equal(lp.text_offset[0], 0);
  for (let i = 0; i < lp.tokens.length; ++i) {
    const vals = Object.values(lp.top_logprobs[i]);
    assert.ok(vals.length >= 1 && vals.length <= 3);
    assert.equal(Math.max(...vals), lp.token_logprobs[i], 'greedy: chosen is the most likely');
    if (i > 0) assert.ok(lp.text_offset[i] >= lp.text_offset[i - 1]);
  }
  const c2 = await off.completions.create(creq);
  assert.deepEqual(c2.choices[0].logprobs, lp, 'completion logprobs: DSpark on and off differ');
  const cs = await on.completions.create({ ...creq, stream: true });
  const tokens = [];
  const values = [];
  for await (const chunk of cs) {
    for (const c of chunk.choices) {
      tokens.push(...(c.logprobs?.tokens ?? []));
      values.push(...(c.logprobs?.token_logprobs ?? []));
    }
  }
  assert.deepEqual(tokens, lp.tokens);
  assert.deepEqual(values, lp.token_logprobs);
  console.log('ok completions logprobs 3, streamed, equal with DSpark off');

  // Sampled (temperature 1, seeded): DSpark on and off give the same tokens and values.
  const sreq = { ...req, temperature: 1, seed: 7 };
  const s1 = await on.chat.completions.create(sreq);
  const s2 = await off.chat.completions.create(sreq);
  checkChatLogprobs(s1.choices[0].logprobs.content, 5, s1.usage.completion_tokens);
  assert.deepEqual(s1.choices[0].logprobs.content, s2.choices[0].logprobs.content,
    'seeded sampling: DSpark on and off differ');
  console.log('ok seeded sampled logprobs equal with DSpark on and off');

  // n: 3 with a seed: three choices from one encoder pass and ONE hand-off (the decode worker's
  // transfer metrics count one more received logits segment), reproducible, the prompt counted
  // once, each choice its own index and finish reason; streaming interleaves them by index.
  // Received transfers per segment kind on the decode worker (each hand-off moves every kind
  // once: the KV state, the DSpark state, the logits).
  const received = async () => {
    const text = await (await fetch(process.env.EPD_DECODE_METRICS)).text();
    const bySegment = {};
    for (const line of text.split('\n')) {
      if (line.startsWith('epd_transfer_duration_seconds_count{') &&
          line.includes('direction="recv"')) {
        const seg = line.match(/segment="([^"]*)"/)[1];
        bySegment[seg] = (bySegment[seg] ?? 0) + Number(line.split(' ').pop());
      }
    }
    return bySegment;
  };
  const handoffs = async () => {
    const r = await received();
    return r;
  };
  const nreq = { model, messages, max_tokens: 10, temperature: 1, seed: 42, n: 3, logprobs: true };
  const one = await on.chat.completions.create({ ...nreq, n: 1 });
  const before = await handoffs();
  const n1 = await on.chat.completions.create(nreq);
  const after = await handoffs();
  assert.ok(Object.keys(after).length > 0, 'no received transfers on the decode worker');
  for (const seg of Object.keys(after)) {
    assert.equal(after[seg] - (before[seg] ?? 0), 1,
      `segment ${seg} received ${after[seg] - (before[seg] ?? 0)} times for one n=3 request`);
  }
  assert.equal(n1.choices.length, 3);
  let sum = 0;
  for (const [i, c] of n1.choices.entries()) {
    assert.equal(c.index, i);
    assert.ok(['stop', 'length'].includes(c.finish_reason));
    sum += c.logprobs.content.length;
  }
  assert.equal(n1.usage.prompt_tokens, one.usage.prompt_tokens, 'prompt counted once');
  assert.equal(n1.usage.completion_tokens, sum, 'completion tokens = sum over choices');
  assert.equal(n1.usage.total_tokens, n1.usage.prompt_tokens + sum);
  assert.equal(n1.choices[0].message.content, one.choices[0].message.content,
    'choice 0 samples with the request seed');
  const texts = n1.choices.map((c) => c.message.content);
  assert.ok(new Set(texts).size > 1, `the choices are all equal: ${JSON.stringify(texts)}`);
  const n2 = await on.chat.completions.create(nreq);
  assert.deepEqual(n2.choices.map((c) => c.message.content), texts, 'n=3 with a seed differs');
  const ns = await on.chat.completions.create({ ...nreq, stream: true,
    stream_options: { include_usage: true } });
  const per = ['', '', ''];
  const finish = [null, null, null];
  let usage = null;
  for await (const chunk of ns) {
    if (chunk.usage) usage = chunk.usage;
    for (const c of chunk.choices) {
      per[c.index] += c.delta?.content ?? '';
      if (c.finish_reason) finish[c.index] = c.finish_reason;
    }
  }
  assert.deepEqual(per, texts, 'streamed n=3 differs');
  assert.deepEqual(finish, n1.choices.map((c) => c.finish_reason));
  assert.deepEqual(usage, n1.usage);
  const cn = await on.completions.create({ model, prompt: 'Once', max_tokens: 6, n: 2, best_of: 2,
    temperature: 1, seed: 9 });
  assert.equal(cn.choices.length, 2);
  assert.deepEqual(cn.choices.map((c) => c.index), [0, 1]);
  // best_of 3 > n 1: the three seeded samples (the same as n = 3 with that seed) are ranked by
  // mean token logprob and the best one is returned; usage counts all three samples' tokens; no
  // logprobs in the answer unless asked; streaming is refused.
  const breq = { model, prompt: 'Once', max_tokens: 6, temperature: 1, seed: 11 };
  const all3 = await on.completions.create({ ...breq, n: 3, logprobs: 1 });
  const best = await on.completions.create({ ...breq, n: 1, best_of: 3 });
  const meanLp = (c) => c.logprobs.token_logprobs.length === 0 ? -Infinity
    : c.logprobs.token_logprobs.reduce((a, b) => a + b, 0) / c.logprobs.token_logprobs.length;
  let bestIdx = 0;
  for (let i = 1; i < 3; ++i) if (meanLp(all3.choices[i]) > meanLp(all3.choices[bestIdx])) bestIdx = i;
  assert.equal(best.choices.length, 1);
  assert.equal(best.choices[0].index, 0);
  assert.equal(best.choices[0].text, all3.choices[bestIdx].text, 'best_of picked another sample');
  assert.equal(best.choices[0].logprobs, null, 'logprobs returned although not asked');
  assert.equal(best.usage.completion_tokens, all3.usage.completion_tokens,
    'best_of usage counts every sample');
  await assert.rejects(on.completions.create({ ...breq, n: 1, best_of: 3, stream: true }),
    (e) => e.status === 400 && e.param === 'best_of');
  await assert.rejects(on.completions.create({ ...breq, n: 3, best_of: 2 }),
    (e) => e.status === 400 && e.param === 'best_of');
  console.log('ok best_of 3 > n 1 returns the sample with the highest mean logprob');
  console.log('ok n=3 seeded: one hand-off, prompt once, reproducible, streamed by index',
    JSON.stringify(texts));

  // usage.completion_tokens_details.reasoning_tokens: 0 without thinking; in thinking mode the
  // tokens up to </think> (all of them when the random model never closes its reasoning).
  const plainUsage = (await on.chat.completions.create({ model, messages, max_tokens: 6 })).usage;
  assert.equal(plainUsage.completion_tokens_details.reasoning_tokens, 0);
  const think = await on.chat.completions.create({ model, messages, max_tokens: 12,
    thinking: true });
  const rt = think.usage.completion_tokens_details.reasoning_tokens;
  assert.ok(rt > 0 && rt <= think.usage.completion_tokens, `reasoning_tokens ${rt}`);
  if (!think.choices[0].message.content) assert.equal(rt, think.usage.completion_tokens);
  console.log('ok reasoning_tokens', rt, 'of', think.usage.completion_tokens);
  console.log('ALL OK');
}

main().catch((e) => {
  console.error('FAILED:', e);
  process.exit(1);
});
