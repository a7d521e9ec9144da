// Structured output and forced tool calls (issue 15) with the official OpenAI Node SDK against
// two real clusters started by tests/e2e/openai_api_test.cc (EPD_BASE_URL: DSpark on,
// EPD_BASE_URL_OFF: DSpark off) on the random-weights nano model. Every output is checked with
// ajv (a JSON Schema validator from npm), not by hand. Exits non-zero on the first failure.
import assert from 'node:assert/strict';
import Ajv from 'ajv';
import OpenAI from 'openai';

const opts = { apiKey: 'none', maxRetries: 0, timeout: 120000 };
const on = new OpenAI({ ...opts, baseURL: process.env.EPD_BASE_URL });
const off = new OpenAI({ ...opts, baseURL: process.env.EPD_BASE_URL_OFF });
const model = 'epd-nano';
const messages = [{ role: 'user', content: 'Describe a person as JSON' }];
const ajv = new Ajv({ strict: false });

const schema = {
  type: 'object',
  properties: {
    name: { type: 'string' },
    age: { type: 'integer' },
    nickname: { type: 'string' },
    tags: { type: 'array', items: { type: 'string' }, minItems: 1, maxItems: 3 },
    address: {
      type: 'object',
      properties: { city: { type: 'string' }, zip: { type: 'string' } },
      required: ['city', 'zip'],
      additionalProperties: false,
    },
    kind: { enum: ['a', 'b', 'c'] },
    score: { anyOf: [{ type: 'number' }, { type: 'null' }] },
    ok: { type: 'boolean' },
    v: { const: 1 },
  },
  required: ['name', 'age', 'tags', 'address', 'kind', 'score', 'ok', 'v'],
  additionalProperties: false,
};
const validate = ajv.compile(schema);
const responseFormat = {
  type: 'json_schema',
  json_schema: { name: 'person', schema, strict: true },
};

const tools = [
  {
    type: 'function',
    function: {
      name: 'get_weather',
      parameters: {
        type: 'object',
        properties: { city: { type: 'string' }, days: { type: 'integer' } },
        required: ['city'],
        additionalProperties: false,
      },
    },
  },
  {
    type: 'function',
    function: {
      name: 'get_time',
      parameters: {
        type: 'object',
        properties: { tz: { enum: ['UTC', 'CET'] } },
        required: ['tz'],
        additionalProperties: false,
      },
    },
  },
];
const toolValidators = Object.fromEntries(
  tools.map((t) => [t.function.name, ajv.compile(t.function.parameters)]));

function checkToolCalls(choice, onlyName) {
  assert.equal(choice.finish_reason, 'tool_calls', JSON.stringify(choice));
  const calls = choice.message.tool_calls;
  assert.ok(Array.isArray(calls) && calls.length >= 1, JSON.stringify(choice.message));
  for (const call of calls) {
    assert.equal(call.type, 'function');
    if (onlyName) assert.equal(call.function.name, onlyName);
    const v = toolValidators[call.function.name];
    assert.ok(v, `unknown tool ${call.function.name}`);
    const args = JSON.parse(call.function.arguments);
    assert.ok(v(args), `arguments ${call.function.arguments}: ${ajv.errorsText(v.errors)}`);
  }
  return calls.length;
}

async function main() {
  // 20 seeded samples (temperature 1), concurrently: every one parses and validates.
  const samples = await Promise.all(Array.from({ length: 20 }, (_, seed) =>
    on.chat.completions.create({
      model, messages, max_tokens: 160, temperature: 1, seed, response_format: responseFormat,
    })));
  for (const [seed, r] of samples.entries()) {
    const text = r.choices[0].message.content;
    let value;
    try {
      value = JSON.parse(text);
    } catch (e) {
      assert.fail(`seed ${seed}: not JSON (${e.message}): ${text}`);
    }
    assert.ok(validate(value), `seed ${seed}: ${ajv.errorsText(validate.errors)}: ${text}`);
  }
  console.log('ok 20/20 seeded json_schema samples validate; e.g.', samples[0].choices[0].message.content);

  // Same seed, same output (reproducible under the mask).
  const again = await on.chat.completions.create({
    model, messages, max_tokens: 160, temperature: 1, seed: 3, response_format: responseFormat,
  });
  assert.equal(again.choices[0].message.content, samples[3].choices[0].message.content);
  console.log('ok seeded constrained output reproducible');

  // Greedy: DSpark on (masked drafts are rejected) equals DSpark off.
  const greedy = { model, messages, max_tokens: 160, temperature: 0, response_format: responseFormat };
  const g1 = await on.chat.completions.create(greedy);
  const g2 = await off.chat.completions.create(greedy);
  assert.ok(validate(JSON.parse(g1.choices[0].message.content)));
  assert.equal(g1.choices[0].message.content, g2.choices[0].message.content,
    'constrained greedy output differs with DSpark on and off');
  console.log('ok constrained greedy equal with DSpark on and off');

  // json_object: any JSON object; streaming gives the same text.
  const jo = { model, messages, max_tokens: 64, temperature: 1, seed: 5,
    response_format: { type: 'json_object' } };
  const o1 = await on.chat.completions.create(jo);
  const parsed = JSON.parse(o1.choices[0].message.content);
  assert.equal(typeof parsed, 'object');
  assert.ok(parsed !== null && !Array.isArray(parsed));
  const stream = await on.chat.completions.create({ ...jo, stream: true });
  let streamed = '';
  for await (const chunk of stream) {
    for (const c of chunk.choices) streamed += c.delta?.content ?? '';
  }
  assert.equal(streamed, o1.choices[0].message.content);
  console.log('ok json_object', o1.choices[0].message.content);

  // tool_choice "required": always a tool call whose arguments validate (8 seeds).
  let total = 0;
  const forced = await Promise.all(Array.from({ length: 8 }, (_, seed) =>
    on.chat.completions.create({
      model, messages: [{ role: 'user', content: 'What is the weather?' }], tools,
      tool_choice: 'required', max_tokens: 400, temperature: 1, seed,
    })));
  for (const r of forced) total += checkToolCalls(r.choices[0]);
  console.log('ok tool_choice required: 8/8 made', total, 'valid calls; e.g.',
    JSON.stringify(forced[0].choices[0].message.tool_calls));

  // A named function, no parallel calls: exactly one call of that function.
  for (let seed = 0; seed < 3; ++seed) {
    const r = await on.chat.completions.create({
      model, messages: [{ role: 'user', content: 'Time?' }], tools, max_tokens: 400,
      tool_choice: { type: 'function', function: { name: 'get_time' } }, temperature: 1, seed,
    });
    assert.equal(checkToolCalls(r.choices[0], 'get_time'), 1);
  }
  const noPar = await on.chat.completions.create({
    model, messages: [{ role: 'user', content: 'Weather?' }], tools, max_tokens: 400,
    tool_choice: 'required', parallel_tool_calls: false, temperature: 1, seed: 11,
  });
  assert.equal(checkToolCalls(noPar.choices[0]), 1);
  console.log('ok named function / parallel_tool_calls false: one call');

  // Refusals in the error shape: a keyword outside the subset is named; an unknown function.
  try {
    await on.chat.completions.create({
      model, messages, response_format: {
        type: 'json_schema',
        json_schema: { name: 'x', schema: { type: 'object', properties: { id: { type: 'string', not: { const: 'a' } } } } },
      },
    });
    assert.fail('a not keyword was accepted');
  } catch (e) {
    assert.ok(e instanceof OpenAI.BadRequestError, `expected BadRequestError, got ${e}`);
    assert.equal(e.param, 'response_format');
    assert.equal(e.code, 'unsupported_value');
    assert.match(e.message, /'not'/);
  }
  try {
    await on.chat.completions.create({
      model, messages, tools, tool_choice: { type: 'function', function: { name: 'nope' } },
    });
    assert.fail('an unknown tool_choice function was accepted');
  } catch (e) {
    assert.ok(e instanceof OpenAI.BadRequestError, `expected BadRequestError, got ${e}`);
    assert.equal(e.param, 'tool_choice');
  }
  console.log('ok refusals name the keyword / param');
  console.log('ALL OK');
}

main().catch((e) => {
  console.error('FAILED:', e);
  process.exit(1);
});
