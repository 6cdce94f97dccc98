-- Fragment (not a script on its own): keys of another Redis type than a script ever writes there.
--
-- move_aside(key, repaired): the key is not ours -- someone else's data, or garbage -- so it is moved aside
-- to <key>:garbage (RENAME: the same hash slot; an older garbage copy is replaced, so memory stays
-- bounded), named in `repaired` (a list the caller reports), logged, and the caller goes on with the key
-- empty, rather than stop every worker of the crawl until someone deletes it by hand.
-- type_ok(key, want, repaired): move_aside the key if its type is neither 'none' nor `want`.
-- types_ok(keys, wants, repaired): type_ok for each keys[i] and wants[i] (a keys[i] not passed is skipped).

local function move_aside(key, repaired)
  redis.call('RENAME', key, key .. ':garbage')
  repaired[#repaired + 1] = key
  redis.log(redis.LOG_WARNING, 'scrapy-dist: ' .. key .. ' held another Redis type: moved to ' .. key ..
            ':garbage')
end

local function type_ok(key, want, repaired)
  local t = redis.call('TYPE', key)['ok']
  if t ~= 'none' and t ~= want then move_aside(key, repaired) end
end

local function types_ok(keys, wants, repaired)
  for i, want in ipairs(wants) do
    if keys[i] then type_ok(keys[i], want, repaired) end
  end
end
